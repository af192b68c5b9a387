"""A plain torch script that joins its process group, then waits (at most 120 s) until the test
writes OUT/go: a job still running while the launcher is expected to speak."""

import sys
import time
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
go = Path(sys.argv[1]) / "go"
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.barrier()
