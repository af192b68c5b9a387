"""Test worker: writes its launcher-visible environment to OUTDIR/rank{RANK}.json after a barrier."""

import json
import os
import sys

import torch
import torch.distributed as dist

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "PHALANX_STRATEGY",
    "PHALANX_MIXED_PRECISION",
    "PHALANX_WATCHDOG_TIMEOUT",
    "PHALANX_DEEPSPEED_CONFIG",
    "PHALANX_GRAD_ACCUM_STEPS",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_MIXED_PRECISION",
)

out_dir = sys.argv[1]
dist.init_process_group("gloo")
dist.barrier()
record = {
    "env": {key: os.environ.get(key) for key in KEYS},
    "env_keys": sorted(os.environ),
    "argv": sys.argv,
    "name": __name__,
    "module_argv0": globals().get("MODULE_ARGV0"),  # set when run through recmod (-m mode)
    "module_name": globals().get("MODULE_NAME"),
    "num_threads": torch.get_num_threads(),
    "world_size": dist.get_world_size(),
}
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fp:
    json.dump(record, fp)
dist.barrier()
dist.destroy_process_group()
