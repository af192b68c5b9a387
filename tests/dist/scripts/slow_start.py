"""A training script for `phalanx run`: after `Phalanx()`, rank 1 holds the interpreter for argv[1]
seconds before its first step, as an extension module's import does (its watchdog thread cannot
beat meanwhile), while rank 0 waits for it in the first step's all-reduce."""

import ctypes
import sys

import torch
from torch import nn

from phalanx import Phalanx

if __name__ == "__main__":
    px = Phalanx(strategy="ddp")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if px.rank == 1:
        ctypes.PyDLL(None).sleep(int(sys.argv[1]))  # libc's sleep under the GIL, as a dlopen holds it
    for _ in range(3):
        optimizer.zero_grad()
        px.backward(model(torch.ones(4, 3)).pow(2).mean())
        optimizer.step()
    print(f"rank {px.rank}: finished", flush=True)
