"""Mixed precision: autocast for replicated strategies, FSDP2's policy for sharded ones, and a
gradient scaler for fp16. One small object a strategy holds; strategies never test the name."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies import names

VALID = names.PRECISIONS
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_name(name: str) -> str:
    key = names.canonical_precision(name)
    if key not in VALID:
        raise ValueError(f"unknown mixed_precision {name!r}; valid values: {', '.join(VALID)}")
    return key


@dataclass
class Precision:
    """What `mixed_precision` means on one device.

    - `no`: fp32 everywhere.
    - `bf16`: forward under autocast(bf16) (replicated strategies) or FSDP2 params cast to bf16
      with fp32 gradient reduction (sharded strategies); no scaler needed.
    - `fp16`: the same with fp16 plus a gradient scaler, whose skip-the-step decision is made
      on the global (all-ranks) inf check so ranks never diverge.
    """

    name: str = "no"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        self.name = check_name(self.name)
        self.dtype = _DTYPES.get(self.name)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self) -> ContextManager[Any]:
        """Autocast to the low precision dtype (a no-op context when disabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def wrap_forward(self, model: nn.Module) -> nn.Module:
        """Run `model.forward` under autocast; the module keeps its identity and fp32 weights."""
        if self.enabled and not getattr(model.forward, "_phalanx_autocast", False):
            inner = model.forward

            @functools.wraps(inner)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with self.autocast():
                    return inner(*args, **kwargs)

            forward._phalanx_autocast = True  # type: ignore[attr-defined]
            model.forward = forward
        return model

    def fsdp_policy(self) -> Any:
        """FSDP2 MixedPrecisionPolicy: compute in low precision, reduce gradients in fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.enabled:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    # ---- the gradient scaler (fp16 only) ----------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients once per step, before clipping or stepping; agree on infs globally."""
        if self.scaler is None:
            return
        state = self.scaler._per_optimizer_states[id(optimizer)]
        if state["stage"].name == "UNSCALED":
            return
        self.scaler.unscale_(optimizer)
        if dist.is_available() and dist.is_initialized():
            # Sharded gradients see different infs per rank: one skipping the step alone would
            # leave the ranks with different weights.
            for found in state["found_inf_per_device"].values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        if self.scaler is None:
            return optimizer.step(closure) if closure is not None else optimizer.step()
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported with mixed_precision='fp16'. "
                             "HINT: call the closure yourself, then optimizer.step().")
        self.unscale_(optimizer)
        result = self.scaler.step(optimizer)
        self.scaler.update()
        return result
