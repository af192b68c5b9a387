"""The seed's pattern: mp.spawn, the script's own init_process_group, then Phalanx().

python own_group.py INIT_FILE OUT_DIR
"""

import sys

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist.spawn_workloads import shard_report, write_report


def main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    write_report(out_dir, shard_report(run_exit_handlers=True))
    dist.destroy_process_group()  # the script created the group, the script ends it


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
