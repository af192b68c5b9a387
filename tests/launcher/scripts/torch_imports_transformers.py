"""A plain torch DDP script that imports transformers and accelerate (as nanoGPT's imports
transformers) but never makes an Accelerator: no Accelerate script."""

import accelerate  # noqa: F401  (imported, never used: what an import of transformers may do)
import torch
import torch.distributed as dist
import transformers  # noqa: F401

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.randn(2, 4)).sum().backward()
dist.destroy_process_group()
