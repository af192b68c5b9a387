"""What the tests ask of the planner and the memory model that phalanx itself never needs: moved here
from src (issue 42: no function in src for tests only)."""

from __future__ import annotations

from typing import Any

from phalanx.config import ConfigError, Resolved
from phalanx.model.memory import ParamSize
from phalanx.strategies.plan import presets, settings_check
from phalanx.strategies.plan.parallel_plan import ParallelPlan


def intended_plan(
    resolved: Resolved, world_size: int, local_world_size: int, strategy: str | None = None, **hybrid: Any
) -> ParallelPlan | None:
    """`checked_plan` of the plan the settings describe on `world_size` processes."""
    name = presets.canonical(strategy or resolved.config.strategy)
    try:  # auto decides between presets of the same degrees, so either one checks them
        built = presets.build(
            presets.AUTO_CHOOSES[0] if name == presets.AUTO else name,
            resolved.config,
            world_size=world_size,
            local_world_size=local_world_size,
            **hybrid,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return settings_check.checked_plan(resolved, built)


def zero1_owners(sizes: list[ParamSize], world_size: int) -> list[int]:
    """Which rank holds each whole parameter's optimizer state under torch's
    ZeroRedundancyOptimizer (greedy, largest first; zero1 itself splits every parameter)."""
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i].numel, reverse=True):
        rank = load.index(min(load))
        owner[i] = rank
        load[rank] += sizes[i].numel
    return owner


def by_preset(
    sizes: list[ParamSize], world_size: int, optimizer: str = "adamw", local_world_size: int | None = None
) -> dict[str, list[Any]]:
    """`phalanx plan`'s rows over `world_size` processes (zero1-persistent, zero3-offload and hsdp
    among them) -> each rank's bytes, from the one memory model keyed by plan."""
    from phalanx.plan import sharding

    rows = sharding.layouts(presets.asking(), world_size=world_size, local_world_size=local_world_size or world_size)
    return sharding.table(sizes, rows, optimizer)
