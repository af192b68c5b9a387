"""`phalanx plan`'s rows are ParallelPlans the presets build, and each row's bytes per rank follow
from its plan's sharding: the same figures as the per-strategy memory table (model/memory.py)."""
from __future__ import annotations

import pytest

from phalanx.model import memory
from phalanx.model.memory import ParamSize
from phalanx.plan import sharding
from phalanx.strategies import presets
from phalanx.strategies.parallel_plan import ParallelPlan

SIZES = [ParamSize("embed", (10, 3), 4), ParamSize("bias", (7,), 4), ParamSize("scale", (), 4),
         ParamSize("head", (5, 6), 2)]


@pytest.mark.parametrize("world, local, tp, pp", [(4, 4, 1, 1), (8, 4, 1, 1), (8, 4, 2, 1), (8, 8, 1, 2),
                                                  (2, 2, 2, 1)])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_rows_are_plans_whose_bytes_equal_the_memory_table(world, local, tp, pp, optimizer):
    rows = sharding.layouts(presets.asking(tp=tp, pp=pp), world_size=world, local_world_size=local)
    assert all(isinstance(plan, ParallelPlan) and plan.degrees()["tp"] == tp and plan.pp == pp for plan in rows.values())
    dp = world // (tp * pp)
    table = memory.plan(SIZES, dp, optimizer, hsdp_shard_size=rows["hsdp"].dp_shard)
    assert sharding.table(SIZES, rows, optimizer) == table
    assert rows["zero3-offload"].cpu_offload and rows["zero1-persistent"] is rows["zero1"]
