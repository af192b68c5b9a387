"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets (ddp, and
zero1 under its sharded-state optimizer)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.strategies.ddp_options import register_comm_hook
from phalanx.strategies.options import StrategyOptions


def apply(model: nn.Module, options: StrategyOptions, device: torch.device, group: Any = None,
          find_unused_parameters: bool | None = None) -> nn.Module:
    """`model` (on `device`) wrapped in DDP over `group` (None: every rank), with the comm hook
    the settings ask for; its state is kept on the wrapper for checkpoints. `find_unused_parameters`:
    what the layout requires whatever the settings say (a pipeline stage: True)."""
    device_ids = [device.index] if device.type == "cuda" else None
    # find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view (default on:
    # gradients live in the communication buckets, one copy fewer per step); ddp_kwargs win.
    kwargs = {**options.ddp.ddp_kwargs(), **options.extra.get("ddp_kwargs", {})}
    if find_unused_parameters is not None:
        kwargs["find_unused_parameters"] = find_unused_parameters
    wrapped = DistributedDataParallel(model, device_ids=device_ids, process_group=group, **kwargs)
    wrapped.phalanx_comm_hook_state = register_comm_hook(wrapped, options.ddp)
    return wrapped
