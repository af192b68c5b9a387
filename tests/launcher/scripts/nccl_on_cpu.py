"""A GPU script's first line, run where no GPU is."""

import torch.distributed as dist

dist.init_process_group("nccl")
dist.destroy_process_group()
