"""Test worker: checkpoints every 2 optimizer steps; on the first attempt rank 1 is killed by SIGKILL
after step 3 (watchdog step 2: its third batch), once its heartbeat has been published; the restarted
group resumes from the checkpoint of step 2 and finishes. Rank 0 writes OUT/resumed.txt."""

import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

px = Phalanx()  # checkpoint dir from phalanx run --checkpoint-dir
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=2)
model, optimizer, loader = px.prepare(model, optimizer, loader)
resumed = px.load_state()
if px.is_main_process:
    with open(os.path.join(sys.argv[1], "resumed.txt"), "a") as f:
        f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {resumed} {px.global_step}\n")
for (x,) in loader:
    optimizer.zero_grad()
    px.backward(model(x).pow(2).mean())
    optimizer.step()
    if px.global_step % 2 == 0:
        px.save_state()
    if px.global_step == 3 and px.rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        time.sleep(2.5)  # two heartbeats: the launcher's store holds this rank's step
        os.kill(os.getpid(), signal.SIGKILL)
    if px.global_step == 6:
        break
