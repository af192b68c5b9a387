"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""
from __future__ import annotations

from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.strategies.base import LocalStrategy


class DDPStrategy(LocalStrategy):
    name = "ddp"

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = super().setup_model(model)
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            # Gradients live in the communication buckets: one copy fewer per step and less memory.
            gradient_as_bucket_view=True,
            **self.options.extra.get("ddp_kwargs", {}),
        )

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return model.no_sync()
