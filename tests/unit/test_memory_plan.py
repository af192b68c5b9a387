"""The one memory model is keyed by plan: auto's budget test and its tp hint ask it with the job's
plan (strategies/memory_plan.py), with the figures the name-keyed table gave."""

from __future__ import annotations

from phalanx.model.memory import ParamSize
from phalanx.strategies import memory_plan
from phalanx.strategies.plan import presets

SIZES = [ParamSize("w", (1000, 1000), 4)]  # 4 MB of parameters
MB = 1000 * 1000


def _plan(world: int, tp: int = 1, pp: int = 1):
    return presets.build("ddp", presets.asking(tp=tp, pp=pp), world_size=world, local_world_size=world)


def test_auto_budget_test_counts_ddp_state_split_over_tp():
    # ddp: params + grads + 2 AdamW states = 16 MB + a 4-byte step, per rank; tp 2 halves it
    assert memory_plan.recommend(SIZES, _plan(2), 16 * MB + 4)[0] == "ddp"
    assert memory_plan.recommend(SIZES, _plan(2), 16 * MB + 3)[0] == "zero3"
    name, why = memory_plan.recommend(SIZES, _plan(4, tp=2), 8 * MB + 2)
    assert (name, why.split(" per rank")[0]) == ("ddp", "ddp needs 7.6 MiB")
    assert memory_plan.recommend(SIZES, _plan(1), 0)[0] == "single"


def test_zero3_peak_and_the_tp_that_would_fit():
    # zero3 over 4 ranks: 1 + 1 + 2 MB at rest (+ the step), + the 4 MB unit gathered whole
    assert memory_plan.zero3_peak(SIZES, _plan(4), 4 * MB) == (4 * MB + 4, 8 * MB + 4)
    assert memory_plan.tp_that_fits(SIZES, _plan(4), 4, 9 * MB, 4 * MB) == ""
    hint = memory_plan.tp_that_fits(SIZES, _plan(4), 4, 6 * MB + 10, 4 * MB)
    assert "tp=2 would fit" in hint, hint
    assert "no tensor-parallel degree" in memory_plan.tp_that_fits(SIZES, _plan(4), 1, 6 * MB + 10, 4 * MB)
    assert "even zero3 over all 4 ranks" in memory_plan.tp_that_fits(SIZES, _plan(4), 4, MB, 4 * MB)
