"""The parallel plan is the layout's one carrier: functions take the plan, not its degrees as loose
integers, and plans are made in one place (presets.build, and job_plan reading the launcher's)."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

DEGREES = {"tp", "pp", "cp", "dp", "dp_size", "tp_size", "pp_size", "cp_size", "dp_replicate", "dp_shard"}

# The few functions that take one dimension's size, each for a reason the plan can't serve.
ARITHMETIC = {
    # rooms below strategies/ (where ParallelPlan lives), called with plan.dp_size / plan.tp by the
    # rooms that hold the plan: formulas over one number
    "data/rank_sampler.py:describe": "the sampler's own data-parallel size, in its message",
    "data/split_batches.py:per_rank_batch_size": "global batch / the data-parallel ranks",
    "data/split_batches.py:not_dividing_message": "the message of the same division",
    # pipeline arithmetic in one variable, the number of pipeline ranks: used before any plan exists
    # (the pp settings' checks, `phalanx plan`, the bench) and by the runner, which passes plan.pp
    "strategies/pipeline/arithmetic.py:bubble_fraction": "a schedule's bubble over pp ranks",
    "strategies/pipeline/arithmetic.py:in_flight": "microbatches a schedule keeps per rank",
    "strategies/pipeline/arithmetic.py:pipeline_figures": "the two above, together",
    "strategies/pipeline/schedules.py:default_microbatches": "2 x pp",
    "strategies/pipeline/schedules.py:stage_indices": "which stages a pipeline rank runs",
    "strategies/pipeline/schedules.py:last_stage_rank": "which pipeline rank runs the last stage",
    "strategies/pipeline/schedules.py:check_microbatches": "the pp_microbatches setting against pp",
    "strategies/pipeline/schedules.py:microbatches_for": "microbatches that split a batch",
    # the plan's builders: their inputs are what a plan is made from
    "strategies/presets.py:hybrid_shape": "hsdp's replicas x shards of the data-parallel ranks, inside build",
    "plan/command.py:_plan": "`phalanx plan` tries tp degrees larger than --tp; each becomes a plan there",
    "strategies/presets.py:check_cp": "the cp degree against the others, inside build, before the plan exists",
    "strategies/presets.py:_indivisible": "the refusal of a degree x tp that does not divide the world, inside build",
    # context parallel's cut of one row over one cp group (ContextParallel passes plan.cp, plan.cp_rank(rank))
    "strategies/context/layout.py:local_indices": "the token positions cp rank i holds: chunks i and 2cp-1-i",
    "strategies/context/shard.py:shard_sequence": "a batch cut over its cp group: that group's size and this rank's index",
    "strategies/context/cut_attention.py:choose_algorithm": "Ulysses when the key/value heads divide over cp",
    "strategies/context/labels.py:shift_before_cut": "labels=: each cp rank's loss is over its share of the row's targets",
    "plan/context.py:_longest": "`phalanx plan --cp` compares the longest row at --cp with cp 1's",
}


def _degree_parameters() -> set[str]:
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                if {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} & DEGREES:
                    found.add(f"{path.relative_to(SRC).as_posix()}:{node.name}")
    return found


def test_no_function_takes_the_degrees_as_loose_integers():
    taking = _degree_parameters()
    assert taking - set(ARITHMETIC) == set(), "take the ParallelPlan (or justify the function in ARITHMETIC)"
    assert set(ARITHMETIC) - taking == set(), "ARITHMETIC names a function that no longer takes a degree"


def test_plans_are_made_in_one_place():
    makers = set()
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "ParallelPlan":
                makers.add(path.relative_to(SRC).as_posix())
    # presets.build makes every plan; job_plan rebuilds the launcher's from its fields, unchanged
    assert makers == {"strategies/presets.py", "strategies/job_plan.py"}


NAMES = {"ddp", "zero1", "zero2", "zero3", "hsdp", "fsdp", "single"}  # "dp" and "auto" mean other things too
# Tables of layouts to test or document, written as a user writes them (a strategy setting's value)
LAYOUT_TABLES = {"strategies/compatibility.py", "model/families.py", "strategies/optimizer_table.py"}


def test_strategy_names_are_spelled_in_one_table():
    spelled = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docstrings:
                spelled.setdefault(path.relative_to(SRC).as_posix(), set()).add(node.value)
    assert set(spelled) - LAYOUT_TABLES == {"config/names.py"}, spelled
