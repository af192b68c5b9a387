"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""
from __future__ import annotations

from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.strategies.base import LocalStrategy
from phalanx.strategies.ddp_options import register_comm_hook


class DDPStrategy(LocalStrategy):
    name = "ddp"

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = super().setup_model(model)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view (default on:
        # gradients live in the communication buckets, one copy fewer per step); ddp_kwargs win.
        kwargs = {**self.options.ddp.ddp_kwargs(), **self.options.extra.get("ddp_kwargs", {})}
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **kwargs)
        wrapped.phalanx_comm_hook_state = register_comm_hook(wrapped, self.options.ddp)
        return wrapped

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return model.no_sync()
