"""mp.spawn with the script's own env:// group (rank 0's process hosts its store), adopted by
Phalanx(); the script ends the group, rank 0 exits at once and rank 1 only some seconds later.

    python own_group_late_exit.py PORT
Rank 1's watchdog must not take the store's host going away after the script ended the group for a
lost rendezvous store: both ranks exit 0.
"""

import os
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist.spawn_workloads import shard_report


def main(rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shard_report()
    dist.destroy_process_group()  # the script created the group, the script ends it
    if rank == 1:
        time.sleep(4)  # rank 0 (and its store) is gone by now; the watchdog wakes every second
    print(f"rank {rank} left", flush=True)


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1],), nprocs=2)
