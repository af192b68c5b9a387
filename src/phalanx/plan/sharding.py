"""`phalanx plan`'s rows as parallel plans: every multi-process preset built over the same degrees
(strategies/plan/presets.py), and each row's per-rank bytes from the one memory model keyed by plan
(strategies/memory_plan.py), not from a table of strategy names. Figures are one tensor-parallel rank's part of one pipeline rank's
stages (`sizes`), spread over the plan's data-parallel ranks."""

from __future__ import annotations

from typing import Any

from phalanx.model.memory import ParamSize, RankBytes
from phalanx.strategies import memory_plan
from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import ParallelPlan, Sharding

PERSISTENT = "-persistent"  # zero1 with zero1_gather persistent: its gather buffers kept between steps
OFFLOAD = "-offload"  # the preset with cpu_offload (the parameter-sharding presets only)


def layouts(settings: Any, *, world_size: int, local_world_size: int) -> dict[str, ParallelPlan]:
    """Row name -> plan: each preset that runs several processes, over the degrees `settings` ask for
    (tp, pp), in the order of the presets table, with the zero1_gather and cpu_offload variants
    after their preset. A preset whose layout cannot be built on these processes (hsdp's replicas
    not fitting the nodes) has no row."""
    rows: dict[str, ParallelPlan] = {}
    for name in presets.multi_process():
        try:
            plan = presets.build(name, settings, world_size=world_size, local_world_size=local_world_size)
        except ValueError:
            continue
        rows[name] = plan
        if plan.sharding is Sharding.OPTIMIZER:
            rows[name + PERSISTENT] = plan
        if plan.sharding >= Sharding.PARAMETERS and not presets.PRESETS[name].hybrid:
            rows[name + OFFLOAD] = presets.build(
                name, settings, world_size=world_size, local_world_size=local_world_size, cpu_offload=True
            )
    return rows


def table(
    sizes: list[ParamSize], rows: dict[str, ParallelPlan], optimizer: str = "adamw", runtime: int = 0
) -> dict[str, list[RankBytes]]:
    """Row name -> per-rank bytes, for `layouts`' rows."""
    return {
        name: memory_plan.rank_bytes(
            sizes, plan, optimizer, persistent_gather=name.endswith(PERSISTENT), runtime=runtime
        )
        for name, plan in rows.items()
    }
