"""`phalanx plan`'s rows are ParallelPlans the presets build over the degrees asked; each row's bytes
per rank come from the one memory model keyed by plan (strategies/memory_plan.py)."""

from __future__ import annotations

import pytest

from phalanx.model.memory import ParamSize
from phalanx.plan import sharding
from phalanx.strategies import memory_plan
from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import ParallelPlan

SIZES = [
    ParamSize("embed", (10, 3), 4),
    ParamSize("bias", (7,), 4),
    ParamSize("scale", (), 4),
    ParamSize("head", (5, 6), 2),
]


@pytest.mark.parametrize("world, local, tp, pp", [(4, 4, 1, 1), (8, 4, 1, 1), (8, 4, 2, 1), (8, 8, 1, 2), (2, 2, 2, 1)])
def test_rows_are_plans_of_the_asked_degrees(world, local, tp, pp):
    rows = sharding.layouts(presets.asking(tp=tp, pp=pp), world_size=world, local_world_size=local)
    assert all(isinstance(plan, ParallelPlan) and plan.tp == tp and plan.pp == pp for plan in rows.values())
    assert rows["zero3-offload"].cpu_offload and rows["zero1-persistent"] is rows["zero1"]
    table = sharding.table(SIZES, rows)
    assert table["zero1-persistent"][0].buffers > 0 == table["zero1"][0].buffers
    assert table["hsdp"] == memory_plan.rank_bytes(SIZES, rows["hsdp"])


def test_cp_ranks_shard_model_state_as_data_parallel_ranks_do():
    # FSDP2 shards over dp_shard x cp, zero1 over the gradient group (data-parallel x cp)
    cp2 = presets.build("zero3", presets.asking(cp=2), world_size=4, local_world_size=4)
    dp4 = presets.build("zero3", presets.asking(), world_size=4, local_world_size=4)
    assert memory_plan.rank_bytes(SIZES, cp2) == memory_plan.rank_bytes(SIZES, dp4)
    z1cp = presets.build("zero1", presets.asking(cp=2), world_size=4, local_world_size=4)
    z1 = presets.build("zero1", presets.asking(), world_size=4, local_world_size=4)
    assert memory_plan.rank_bytes(SIZES, z1cp) == memory_plan.rank_bytes(SIZES, z1)
