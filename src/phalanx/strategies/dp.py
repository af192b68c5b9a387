"""torch.nn.DataParallel: one process driving every visible GPU (threads, not processes).

Kept for users coming from `nn.DataParallel`; ddp is faster even on one machine. On CPU there is
nothing to split over, so it is a plain single-device run, and says so.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from phalanx.runtime.context import DistContext
from phalanx.strategies.base import LocalStrategy, StrategyOptions


class DPStrategy(LocalStrategy):
    name = "dp"

    def __init__(self, ctx: DistContext, options: StrategyOptions | None = None):
        if ctx.is_distributed:
            raise ValueError(
                f"strategy 'dp' runs in ONE process over the visible GPUs, but this job has "
                f"world_size={ctx.world_size}. HINT: use strategy='ddp' with several processes, "
                "or run the script with plain `python` for dp."
            )
        super().__init__(ctx, options)

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = self.place(model)
        if self.ctx.device.type == "cuda" and torch.cuda.device_count() > 1:
            # Autocast goes on the wrapper: replicas copy the inner module's attributes, so a
            # patched inner forward would run the original module; DataParallel carries the
            # autocast state into its threads.
            return self.precision.wrap_forward(nn.DataParallel(model))
        model = self.precision.wrap_forward(model)
        where = "on CPU" if self.ctx.device.type != "cuda" else "with one visible GPU"
        warnings.warn(f"phalanx: strategy 'dp' {where} is a single-device run: it trains on ONE device "
                      f"({self.ctx.device}), with nothing to split the batch over. HINT: for several "
                      "processes use strategy 'ddp' under `phalanx run` (or phalanx.spawn).", stacklevel=3)
        return model
