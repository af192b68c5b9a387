"""torch.nn.DataParallel: one process driving every visible GPU (threads, not processes).

Kept for users coming from `nn.DataParallel`; ddp is faster even on one machine. On CPU there is
nothing to split over, so it is a plain single-device run, and says so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from phalanx.loop.precision import Precision


def apply(model: nn.Module, precision: Precision, device: torch.device) -> nn.Module:
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        # Autocast goes on the wrapper: replicas copy the inner module's attributes, so a
        # patched inner forward would run the original module; DataParallel carries the
        # autocast state into its threads.
        return precision.wrap_forward(nn.DataParallel(model))
    model = precision.wrap_forward(model)
    where = "on CPU" if device.type != "cuda" else "with one visible GPU"
    warnings.warn(
        f"phalanx: strategy 'dp' {where} is a single-device run: it trains on ONE device "
        f"({device}), with nothing to split the batch over. HINT: for several "
        "processes use strategy 'ddp' under `phalanx run` (or phalanx.spawn).",
        stacklevel=4,
    )
    return model
