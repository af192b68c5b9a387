"""A 60-step DDP loop that ends one way (tests/launcher/test_every_end.py): `ends.py OUT KIND HOW`.

KIND: `plain` (torch alone: init_process_group, DDP, no Phalanx()) or `phalanx` (Phalanx() and
px.prepare). HOW, at step 3 of rank 1 unless said: `finish` (all 60 steps), `raise`, `exit3`
(sys.exit(3)), `sigkill` (kills itself), `hang` (sleeps: a plain script's collective timeout of
5 s, or phalanx's watchdog, ends it), `train` (all 60 steps, slowly: the test signals the
launcher). Each rank writes OUT/step-RANK with the last step it began."""

import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch

out, kind, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
if kind == "phalanx":
    from phalanx import Phalanx

    px = Phalanx()
    model, optimizer = px.prepare(model, optimizer)
    backward = px.backward
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5 if how == "hang" else 60))
    model = DistributedDataParallel(model)

    def backward(loss: torch.Tensor) -> None:
        loss.backward()


for step in range(60):
    (out / f"step-{rank}").write_text(str(step))
    if rank == 1 and step == 3:
        if how == "raise":
            raise RuntimeError("rank 1 fails on purpose at step 3")
        if how == "exit3":
            sys.exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(120)
    optimizer.zero_grad()
    backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    if how == "train":
        time.sleep(0.2)
