"""Run by test_plan_activations in a fresh process: a real CPU forward/backward, with or without
torch.utils.checkpoint on each block, its resident-memory growth next to the meta-device estimate.

    python -m tests.unit.activation_rss [ac]   (with MALLOC_MMAP_THRESHOLD_=65536, so that every
    large tensor is its own mapping and resident memory follows what is allocated)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from phalanx.plan import activations
from phalanx.model.units import default_units

SHAPE = (256, 256)  # big activations next to small parameters: resident memory is mostly them


class Block(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(1000, 64), nn.Linear(64, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.checkpointed = checkpointed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h.mean(1))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the peak (VmHWM) afresh from the current resident size: the process's earlier high
    water mark (imports, or library pages the kernel dropped since under memory pressure) must not
    count as this step's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def main() -> None:
    torch.set_num_threads(1)
    checkpointed = sys.argv[1:] == ["ac"]
    torch.manual_seed(0)
    model, tokens = Net(checkpointed), torch.randint(0, 1000, SHAPE)
    model(tokens[:2]).sum().backward()  # warm up; gradients allocated before measuring
    with torch.device("meta"):
        meta = Net()
    est = activations.measure(meta, [activations.meta_input(SHAPE, torch.int64)], default_units(meta))
    base = _rss()
    _reset_peak()
    out = model(tokens)
    after_forward = _rss() - base
    out.sum().backward()
    peak = _peak() - base
    print(
        json.dumps(
            {
                "after_forward": after_forward,
                "peak": peak,
                "full": est.full,
                "peak_full": est.peak,
                "kept_checkpointed": est.outside + sum(est.unit_inputs),
                "peak_checkpointed": est.peak_checkpointed,
            }
        )
    )


if __name__ == "__main__":
    main()
