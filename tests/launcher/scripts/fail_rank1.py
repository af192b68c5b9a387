"""Test worker: rank 1 raises after the process group is up; the others wait to be stopped."""

import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if os.environ["RANK"] == "1":
    raise RuntimeError("deliberate failure on rank one")
time.sleep(60)
