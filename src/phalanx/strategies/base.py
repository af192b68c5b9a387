"""The narrow interface every strategy implements; the facade talks only to this."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable, Protocol

import torch
from torch import nn

from phalanx.runtime.context import DistContext


@dataclass
class StrategyOptions:
    """Settings a strategy may use; strategies ignore what does not apply to them."""

    mixed_precision: str = "no"
    extra: dict[str, Any] = field(default_factory=dict)


class Strategy(Protocol):
    """How a model and optimizer are spread over ranks and kept in step."""

    name: str

    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move `model` to the device and wrap it for this strategy."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """Make `optimizer` act on the parameters of the wrapped `model`."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaling it when the strategy needs to)."""

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip gradient synchronisation inside the block (accumulation micro-steps)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper the strategy added."""

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all ranks; return that norm."""


class LocalStrategy:
    """Shared behaviour of the strategies whose model holds full, unsharded parameters."""

    name = "local"

    def __init__(self, ctx: DistContext, options: StrategyOptions | None = None):
        self.ctx = ctx
        self.options = options or StrategyOptions()

    def setup_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.ctx.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        while hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        return model

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        # Gradients are identical on every rank after the all-reduce: the local norm is global.
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
