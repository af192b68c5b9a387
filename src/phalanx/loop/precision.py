"""Mixed precision: autocast for replicated strategies, FSDP2's policy for sharded ones, and a
gradient scaler for fp16. One small object a strategy holds; strategies never test the name."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from torch import nn

from phalanx.config import names

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
    - `fp16`: the same with fp16 plus a gradient scaler, whose skip-the-step decision is the
      same on every rank: replicated strategies all-reduce gradients before the inf check, so every
      rank sees the same infs; `sharded` strategies (each rank checks only its shard) use torch's
      ShardedGradScaler, which all-reduces the inf flag.
    """

    name: str = "no"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sharded: bool = False  # each rank holds part of the gradients (zero2/zero3, tensor parallel, pipeline stages)

    def __post_init__(self) -> None:
        self.name = check_name(self.name)
        self.dtype = _DTYPES.get(self.name)
        self.scaler: Any = None
        if self.name == "fp16":
            if self.sharded:
                self.scaler = _sharded_scaler(self.device.type)
            else:
                self.scaler = torch.amp.GradScaler(self.device.type)
        self._unscaled: set[int] = set()  # optimizers unscaled since the scaler's last update()

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

    def loss_scale(self) -> float | torch.Tensor:
        """What `backward` multiplies a loss by: fp16's current scale (a tensor), else 1 (for a
        pipeline, whose schedule runs backward itself)."""
        if self.scaler is None:
            return 1.0
        return self.scaler.scale(torch.ones((), device=self.device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients once per step, before clipping or stepping (torch refuses a second
        unscale_ before update(), and clipping unscales before the step does)."""
        if self.scaler is None or id(optimizer) in self._unscaled:
            return
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        if self.scaler is None:
            return optimizer.step(closure) if closure is not None else optimizer.step()
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported with mixed_precision='fp16'. "
                "HINT: call the closure yourself, then optimizer.step()."
            )
        self.unscale_(optimizer)
        result = self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.clear()
        return result


class _ParamGroups:
    """An optimizer's param_groups, narrowed: what a grad scaler's unscale reads."""

    def __init__(self, param_groups: list[dict[str, Any]]):
        self.param_groups = param_groups


def _sharded_scaler(device_type: str) -> Any:
    """torch's ShardedGradScaler, whose unscale takes DTensor and plain gradients apart: tensor
    parallel without FSDP2 (dp 1) leaves the layers its plan does not split as plain tensors beside
    its DTensors, and one foreach over both fails ("mixed torch.Tensor and DTensor")."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class MixedGradScaler(ShardedGradScaler):
        def _unscale_grads_(
            self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
        ) -> dict[torch.device, torch.Tensor]:
            groups = optimizer.param_groups
            kinds = {type(p.grad) for g in groups for p in g["params"] if p.grad is not None}
            if len(kinds) <= 1:
                return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            found: dict[torch.device, torch.Tensor] = {}
            for kind in kinds:  # the same found_inf per device, accumulated in place by each call
                part = _ParamGroups([{**g, "params": [p for p in g["params"] if type(p.grad) is kind]} for g in groups])
                found.update(super()._unscale_grads_(part, inv_scale, found_inf, allow_fp16))
            return found

    return MixedGradScaler(device_type)
