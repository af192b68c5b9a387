"""The MLP workload the loop benchmarks share (width from BENCH_HIDDEN, to vary bucket counts),
and a timed round of its steps."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

HIDDEN, LAYERS, BATCH = int(os.environ.get("BENCH_HIDDEN", 512)), 4, 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, HIDDEN), nn.ReLU()]
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, 10))


def dataset(num_samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(num_samples, 64, generator=g), torch.randint(0, 10, (num_samples,), generator=g))


def endless(loader):
    """The loader's batches over and over."""
    while True:
        yield from loader


def run_round(steps: int, batches, model, opt, backward) -> float:
    """Steps/s over `steps` steps, every rank starting and ending together."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    dist.barrier()
    return steps / (time.perf_counter() - start)
