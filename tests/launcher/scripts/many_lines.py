"""Worker script: after a barrier (so ranks print at the same time), print N lines to stdout and
N // 10 to stderr, each `rank<R> <stream> <i> xxx...`: a merged or broken line cannot match that."""

import os
import sys

import torch.distributed as dist

count = int(sys.argv[1])
rank = os.environ["RANK"]
dist.init_process_group("gloo")
dist.barrier()
for i in range(count):
    print(f"rank{rank} out {i:05d} " + "x" * 100)
    if i % 10 == 0:
        print(f"rank{rank} err {i:05d} " + "y" * 100, file=sys.stderr)
dist.barrier()
dist.destroy_process_group()
