"""The narrow interface every strategy implements; the facade talks only to this."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ContextManager, Iterable, Protocol, Union

import torch
from torch import nn

from phalanx.runtime.context import DistContext
from phalanx.strategies.ddp_options import DDPOptions
from phalanx.loop.precision import Precision
from phalanx.model.units import ShardSpec



@dataclass
class StrategyOptions:
    """Settings a strategy may use; strategies ignore what does not apply to them."""

    mixed_precision: str = "no"
    """'no', 'bf16' or 'fp16'."""
    cpu_offload: bool = False
    """zero3: keep sharded parameters, gradients and optimizer state in CPU memory."""
    shard_modules: ShardSpec = None
    """zero2/zero3 wrapping units; default: each block of a top-level ModuleList/Sequential (the
    rest stays in the root unit), else each top-level child with parameters."""
    forward_prefetch: bool | None = None
    """zero2/zero3: issue the next unit's all-gather before the current one computes. None: on
    (also on CPU: with embeddings looked up where their rows live it measured faster in 7 of 9
    side-by-side runs of bench/strategies.py, +2-5%); False: off."""
    embedding_exchange: str = "auto"
    """zero2/zero3: 'auto': root-level embedding tables stay sharded by rows and each forward
    exchanges the looked-up rows or the table, whichever is smaller (strategies/sharded_embedding.py);
    'params': FSDP2 gathers them whole like any parameter."""
    init_weights: Callable[[nn.Module], None] | None = None
    """A model built on the meta device: fn(module) initialising one module's own parameters and
    buffers, called per module at prepare (default: the module's reset_parameters())."""
    activation_checkpointing: Any = None
    """True (each sharding unit), module classes or class names, or a predicate module -> bool."""
    compile: Any = None
    """True or a dict of torch.compile options: compile each sharding unit's forward."""
    replicate_size: int | None = None
    """hsdp: replica groups (default: world size / shard_size, i.e. one per node)."""
    shard_size: int | None = None
    """hsdp: ranks each replica's parameters are sharded over (default: the processes per node)."""
    memory_budget_bytes: int | None = None
    """auto: per-device bytes the model state may take under ddp (default: from the device)."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """ddp/zero1: DistributedDataParallel's options and comm hook (from the settings schema)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Strategy-specific keyword arguments, e.g. {'ddp_kwargs': {...}}."""

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, **overrides: Any) -> "StrategyOptions":
        """Build from a user dict, refusing unknown keys (a typo must not be silently ignored)."""
        values = {**(values or {}), **{k: v for k, v in overrides.items() if v is not None}}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown strategy option(s) {unknown}; valid options: {sorted(known)}")
        return cls(**values)


class Strategy(Protocol):
    """How a model and optimizer are spread over ranks and kept in step."""

    name: str
    precision: Precision

    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move `model` to the device and wrap it for this strategy."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        """Make `optimizer` act on the parameters of the wrapped `model` (same groups/hyperparameters)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaling it when the strategy needs to)."""

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip gradient synchronisation inside the block (accumulation micro-steps)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper the strategy added."""

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all ranks; return that norm (a plain tensor)."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights (on CPU for sharded strategies) on the main process."""


class LocalStrategy:
    """Shared behaviour of the strategies whose model holds full, unsharded parameters."""

    name = "local"

    def __init__(self, ctx: DistContext, options: StrategyOptions | None = None):
        self.ctx = ctx
        self.options = options or StrategyOptions()
        self.precision = Precision(self.options.mixed_precision, ctx.device)

    def place(self, model: nn.Module) -> nn.Module:
        """The model on the device, initialised if built on meta, its units checkpointed/compiled."""
        from phalanx.model import meta_init
        from phalanx.model.units import default_units, transform_units

        if meta_init.is_meta(model):  # replicated: every rank holds it whole anyway
            meta_init.materialize(model, self.ctx.device, self.options.init_weights)
        transform_units(model, default_units(model), self.options.activation_checkpointing, self.options.compile,
                        self.ctx.device)
        return model.to(self.ctx.device)

    def setup_model(self, model: nn.Module) -> nn.Module:
        return self.precision.wrap_forward(self.place(model))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        return optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        while hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        return model

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        # Gradients are identical on every rank after the all-reduce: the local norm is global.
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # Every rank holds the full weights already; detached so later steps do not change them.
        return {k: v.detach() for k, v in self.unwrap(model).state_dict().items()}
