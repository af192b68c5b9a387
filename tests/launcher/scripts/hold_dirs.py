"""A job for `phalanx run --checkpoint-dir C --run-dir R`: resume if it can, train to step 4 with a
checkpoint at steps 2 and 4, print where it started, then wait (up to 60 s) for the file argv[1]."""

import os
import sys
import time

import torch

from phalanx import Phalanx

if __name__ == "__main__":
    px = Phalanx(strategy="ddp")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    px.load_state()
    print(f"rank {px.rank}: started at step {px.global_step} (pid {os.getpid()})", flush=True)
    while px.global_step < 4:
        optimizer.zero_grad()
        px.backward(model(torch.ones(4, 3)).pow(2).mean())
        optimizer.step()
        if px.global_step % 2 == 0:
            px.save_state()
    print(f"rank {px.rank}: holding at step {px.global_step}", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"rank {px.rank}: finished", flush=True)
