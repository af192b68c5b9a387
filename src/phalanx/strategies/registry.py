"""Strategy names -> factories. An unknown name lists the valid ones."""
from __future__ import annotations

from typing import Callable

from phalanx.runtime.context import DistContext
from phalanx.strategies.base import Strategy, StrategyOptions
from phalanx.strategies.auto import AutoStrategy
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.dp import DPStrategy
from phalanx.strategies.fsdp import FSDPStrategy, Zero2Strategy
from phalanx.strategies.hsdp import HSDPStrategy
from phalanx.strategies.single import SingleDeviceStrategy
from phalanx.strategies.zero1 import Zero1Strategy

Factory = Callable[[DistContext, StrategyOptions], Strategy]

STRATEGIES: dict[str, Factory] = {
    "single": SingleDeviceStrategy,
    "dp": DPStrategy,
    "ddp": DDPStrategy,
    "zero1": Zero1Strategy,
    "zero2": Zero2Strategy,
    "zero3": FSDPStrategy,
    "hsdp": HSDPStrategy,
    "auto": AutoStrategy,
}
ALIASES: dict[str, str] = {"fsdp": "zero3"}
# Strategies that mean nothing without peers and fall back to a plain single-device run.
WORLD_OF_ONE_IS_SINGLE: set[str] = {"ddp", "zero1", "zero2", "zero3", "hsdp", "auto"}


def valid_names() -> list[str]:
    return sorted([*STRATEGIES, *ALIASES])


def resolve_name(name: str, ctx: DistContext) -> str:
    """Map an alias to a registered name; raise ValueError listing valid names."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid strategies: {', '.join(valid_names())}")
    if not ctx.is_distributed and key in WORLD_OF_ONE_IS_SINGLE:
        return "single"  # one script, every scale: nothing to distribute in a world of one
    return key


def create(name: str, ctx: DistContext, options: StrategyOptions | None = None) -> Strategy:
    return STRATEGIES[resolve_name(name, ctx)](ctx, options or StrategyOptions())
