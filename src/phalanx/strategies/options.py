"""How a parallel plan is applied to a model: the options that are not degrees of the layout
(which modules form units, how tables are exchanged, how the model is initialised, checkpointed,
compiled, split by tensor parallel and cut into pipeline stages, DDP's options)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from torch import nn

from phalanx.model.units import ShardSpec
from phalanx.strategies.ddp_options import DDPOptions
from phalanx.strategies.dimensions import DimensionOptions


@dataclass
class StrategyOptions(DimensionOptions):
    """Settings a strategy may use; strategies ignore what does not apply to them. The options of the
    dimensions applied to each model (ep's ep_plan and capacity_factor) are declared with them and
    gathered in `DimensionOptions` (strategies/dimensions.py)."""

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
    zero1_gather: str = "bucketed"
    """zero1: 'bucketed' (transient gather buffers) or 'persistent' (one buffer kept between steps)."""
    zero1_grads: str = "all_reduce"
    """zero1: 'all_reduce' (DDP's) or 'reduce_scatter' (each rank receives its own rows: zero1_grads.py)."""
    init_weights: Callable[[nn.Module], None] | None = None
    """A model built on the meta device: fn(module) initialising one module's own parameters and
    buffers, called per module at prepare (default: the module's reset_parameters())."""
    activation_checkpointing: Any = None
    """True (each sharding unit), module classes or class names, or a predicate module -> bool."""
    compile: Any = None
    """True or a dict of torch.compile options: compile each sharding unit's forward."""
    tp_plan: dict[str, str] | None = None
    """tp > 1: {module name pattern: style}; None: the model's own transformers plan."""
    sequence_parallel: bool = False
    """tp > 1: activations between the split layers stay split along the sequence."""
    pp_schedule: str = "1F1B"
    """pp > 1: torch's pipeline schedule (strategies/pipeline/schedules.py)."""
    pp_microbatches: int | None = None
    """pp > 1: microbatches per pipeline step (None: 2 x pp)."""
    pp_split: list[str] | None = None
    """pp > 1: unit names to cut stages before (None: even by parameter count)."""
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

    def compiled(self, spec: dict[str, Any]) -> "StrategyOptions":
        """These options with each sharding unit compiled with torch.compile options `spec` (a model
        the script compiled before prepare)."""
        return replace(self, compile=spec)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, **overrides: Any) -> "StrategyOptions":
        """Build from a user dict, refusing unknown keys (a typo must not be silently ignored)."""
        values = {**(values or {}), **{k: v for k, v in overrides.items() if v is not None}}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown strategy option(s) {unknown}; valid options: {sorted(known)}")
        return cls(**values)
