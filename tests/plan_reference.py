"""What the tests ask of the planner and the memory model that phalanx itself never needs: moved here
from src (issue 42: no function in src for tests only)."""
from __future__ import annotations

from typing import Any

from phalanx.config import Resolved
from phalanx.model.memory import ParamSize
from phalanx.strategies import presets, settings_check
from phalanx.strategies.parallel_plan import ParallelPlan


def intended_plan(resolved: Resolved, world_size: int, local_world_size: int,
                  strategy: str | None = None, **hybrid: Any) -> ParallelPlan | None:
    """`checked_plan` of the plan the settings describe on `world_size` processes."""
    name = presets.canonical(strategy or resolved.config.strategy)
    built = settings_check._build(name, resolved, world_size, local_world_size, **hybrid)
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
