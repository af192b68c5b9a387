"""Strategy names -> factories. An unknown name lists the valid ones."""
from __future__ import annotations

from typing import Callable

from phalanx.runtime.context import DistContext
from phalanx.config import names
from phalanx.strategies.base import Strategy, StrategyOptions
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
}
AUTO = "auto"  # not a strategy: the facade decides (strategies/auto.py) once the model is known
ALIASES: dict[str, str] = names.STRATEGY_ALIASES
assert set(names.STRATEGIES) == {*STRATEGIES, *ALIASES, AUTO}, "config/names.py lists every registered name"
# Strategies that mean nothing without peers and fall back to a plain single-device run.
WORLD_OF_ONE_IS_SINGLE: set[str] = {"ddp", "zero1", "zero2", "zero3", "hsdp", "auto"}


def valid_names() -> list[str]:
    return sorted([*STRATEGIES, *ALIASES, AUTO])


def resolve_name(name: str, ctx: DistContext) -> str:
    """Map an alias to a registered name (or auto); raise ValueError listing valid names."""
    key = names.canonical_strategy(name)
    if key not in STRATEGIES and key != AUTO:
        raise ValueError(f"unknown strategy {name!r}; valid strategies: {', '.join(valid_names())}")
    if not ctx.is_distributed and key in WORLD_OF_ONE_IS_SINGLE:
        return "single"  # one script, every scale: nothing to distribute in a world of one
    return key


def create(name: str, ctx: DistContext, options: StrategyOptions | None = None) -> Strategy:
    """The strategy `name` stands for; `auto` must have been decided first (strategies/auto.py)."""
    key = resolve_name(name, ctx)
    if key == AUTO:
        raise ValueError("strategy auto is decided from the model: call strategies.auto.decide first")
    return STRATEGIES[key](ctx, options or StrategyOptions())
