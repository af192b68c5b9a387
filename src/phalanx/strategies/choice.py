"""The strategy a run asked for, from resolved settings: name, options, accumulation and clipping.

Settings were merged and checked once (phalanx.config, DeepSpeed JSON included); this only turns
them into what the strategy registry and the optimizer wrapper take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from phalanx.config import RUNTIME
from phalanx.config import deepspeed as deepspeed_config
from phalanx.config.names import Needs
from phalanx.strategies.ddp_options import DDPOptions
from phalanx.strategies.options import StrategyOptions

DDP_SETTINGS: tuple[str, ...] = tuple(s.name for s in RUNTIME if s.needs is Needs.DDP)


@dataclass
class StrategyChoice:
    strategy: str
    options: StrategyOptions
    grad_accum_steps: int = 1
    grad_accum_remainder: str = "flush"  # an epoch's last, incomplete cycle: flush (step) or drop
    gradient_clipping: float | None = None  # clip before every optimizer.step() (DeepSpeed's key)
    deepspeed: deepspeed_config.DeepSpeedConfig | None = None


def choose(resolved: Any, strategy_options: Mapping[str, Any] | StrategyOptions | None = None) -> StrategyChoice:
    """`resolved`: phalanx.config.Resolved (the settings, where each came from, the DeepSpeed config)."""
    cfg, deepspeed = resolved.config, resolved.deepspeed
    if isinstance(strategy_options, StrategyOptions):
        options = strategy_options
    else:
        options = StrategyOptions.from_dict(dict(strategy_options or {}))
    if deepspeed is not None and deepspeed.cpu_offload and not options.cpu_offload:
        options.cpu_offload = True
    if options.mixed_precision == "no" or cfg.mixed_precision != "no":
        options.mixed_precision = cfg.mixed_precision
    if options.memory_budget_bytes is None:
        options.memory_budget_bytes = cfg.memory_budget
    if resolved.is_set("activation_checkpointing"):
        options.activation_checkpointing = cfg.activation_checkpointing
    if resolved.is_set("embedding_exchange"):
        options.embedding_exchange = cfg.embedding_exchange
    if resolved.is_set("zero1_gather"):
        options.zero1_gather = cfg.zero1_gather
    if resolved.is_set("zero1_grads"):
        options.zero1_grads = cfg.zero1_grads
    if resolved.is_set("compile"):
        options.compile = cfg.compile
    if cfg.tp_plan is not None:
        options.tp_plan = dict(cfg.tp_plan)
    options.sequence_parallel = options.sequence_parallel or cfg.sequence_parallel
    options.pp_schedule, options.pp_microbatches = cfg.pp_schedule, cfg.pp_microbatches
    options.pp_split = list(cfg.pp_split) if cfg.pp_split is not None else None
    given = tuple(name for name in DDP_SETTINGS if resolved.is_set(name))
    options.ddp = DDPOptions(**{name: getattr(cfg, name) for name in DDP_SETTINGS}, given=given)
    return StrategyChoice(
        strategy=cfg.strategy,
        options=options,
        grad_accum_steps=cfg.grad_accum_steps,
        grad_accum_remainder=cfg.grad_accum_remainder,
        gradient_clipping=deepspeed.gradient_clipping if deepspeed is not None else None,
        deepspeed=deepspeed,
    )
