"""The parallel plan is the layout's one carrier: functions take the plan, not its degrees as loose
integers, no degree arithmetic happens outside the plan module and presets (the plan's properties
and methods answer), and plans are made in presets only (job_plan hands the launcher's on, one per
membership, and rebuilds one only when asked for another, saying so)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from phalanx.strategies.plan import job_plan, presets

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

DEGREES = {"tp", "pp", "cp", "dp", "dp_size", "tp_size", "pp_size", "cp_size", "dp_replicate", "dp_shard"}

# The few functions that take one dimension's size, each for a reason the plan can't serve.
ARITHMETIC = {
    # rooms below strategies/ (where ParallelPlan lives), called with plan.dp_size / plan.tp by the
    # rooms that hold the plan: formulas over one number
    "data/rank_sampler.py:describe": "the sampler's own data-parallel size, in its message",
    "model/router_balance.py:pipeline_refusal": "whether there is a pipeline (pp > 1), and pp in its message",
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
    "strategies/plan/presets.py:hybrid_shape": "hsdp's replicas x shards of the data-parallel ranks, inside build",
    "plan/command.py:_plan": "`phalanx plan` tries tp degrees larger than --tp; each becomes a plan there",
    "strategies/plan/presets.py:check_cp": "the cp degree against the others, inside build, before the plan exists",
    "strategies/plan/presets.py:_indivisible": "the refusal of a degree x tp that does not divide the world, inside build",
    "strategies/plan/presets.py:check_flags": "`phalanx plan`'s --tp/--pp/--cp against --world-size, before any plan",
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


# Where degree arithmetic belongs: the plan's own properties, and the presets that build plans
PLAN_HOMES = {"strategies/plan/parallel_plan.py", "strategies/plan/presets.py"}
WORLD = {"world_size", "local_world_size", "nproc", "nproc_per_node", "nnodes"}


def _name(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def _has_degree(node: ast.AST) -> bool:
    return _name(node) in DEGREES or (
        isinstance(node, ast.BinOp) and (_has_degree(node.left) or _has_degree(node.right))
    )


def _size(node: ast.AST) -> bool:
    """A degree, a world size, a whole number, or arithmetic with one of them."""
    return (
        _name(node) in DEGREES | WORLD
        or (isinstance(node, ast.Constant) and type(node.value) is int)
        or (isinstance(node, ast.BinOp) and (_size(node.left) or _size(node.right)))
    )


def _degree_arithmetic() -> list[str]:
    """`plan.dp * plan.tp`, `world // tp`, `2 * settings.cp`, `nproc % args.tp`: a degree (an attribute
    or a local of that name) multiplied, divided or taken modulo by another degree, a world size or
    a number, outside the plan's homes and the ARITHMETIC functions (which take one degree, named)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        if where in PLAN_HOMES:
            continue
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div, ast.FloorDiv, ast.Mod))):
                continue
            if not ((_has_degree(node.left) and _size(node.right)) or (_has_degree(node.right) and _size(node.left))):
                continue
            inside = [f"{where}:{f.name}" for f in functions if f.lineno <= node.lineno <= f.end_lineno]
            if not set(inside) & set(ARITHMETIC):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_degree_arithmetic_outside_the_plan_and_presets():
    assert _degree_arithmetic() == [], "ask the ParallelPlan (a property or method) or a presets function"


def test_the_arithmetic_finder_sees_what_it_should():
    def finds(code: str) -> bool:
        node = ast.parse(code, mode="eval").body
        return (_has_degree(node.left) and _size(node.right)) or (_has_degree(node.right) and _size(node.left))

    for code in (
        "plan.dp_size * plan.tp",
        "world_size // tp",
        "2 * settings.tp * settings.pp",
        "nproc % cfg.tp",
        "args.world_size % (d * args.tp)",
        "plan.world_size // pp",
    ):
        assert finds(code), code
    for code in ("weight.shape[0] % tp", "seq // cp", "batch_size // ctx.dp_size"):
        assert not finds(code), code


def test_plans_are_made_in_presets_only():
    makers, replaced = set(), set()
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = getattr(node.func, "id", getattr(node.func, "attr", None))
            if called == "ParallelPlan":
                makers.add(where)
            if called == "replace" and node.args and "plan" in (_name(node.args[0]) or "").lower():
                replaced.add(where)  # dataclasses.replace(plan, ...): a plan made elsewhere
    # presets.build makes every plan (presets.restored: the launcher's, from its fields, unchanged)
    assert makers == {"strategies/plan/presets.py"}
    assert replaced == set(), "make the plan in presets (e.g. presets.decided)"


def _sizes(*worlds: int) -> str:
    cfg = presets.asking()
    return job_plan.hand_off(
        (
            job_plan.build("zero3", cfg, world_size=w, local_world_size=2),
            job_plan.inputs("zero3", cfg, world_size=w, local_world_size=2),
        )
        for w in worlds
    )


def test_each_membership_of_an_elastic_job_adopts_its_handed_plan(monkeypatch, caplog):
    handed = _sizes(2, 4, 6)  # `phalanx run --nnodes 1:3 --nproc-per-node 2`
    monkeypatch.setattr(presets, "build", lambda *a, **k: pytest.fail("a handed membership built a plan"))
    for world in (2, 4, 6):
        plan = job_plan.plan_for("zero3", presets.asking(), handed, world_size=world, local_world_size=2)
        assert (plan.world_size, plan.dp_shard) == (world, world)
    assert not caplog.records


def test_a_plan_the_launcher_did_not_hand_is_rebuilt_saying_why(caplog):
    handed = _sizes(4)
    with caplog.at_level(logging.INFO, logger="phalanx"):
        plan = job_plan.plan_for("zero3", presets.asking(), handed, world_size=2, local_world_size=2)
        assert plan.world_size == 2
        job_plan.plan_for("ddp", presets.asking(), handed, world_size=4, local_world_size=2)
    assert [r.getMessage() for r in caplog.records] == [
        "this process builds its own parallel plan: world_size 2 (launcher: 4)",
        "this process builds its own parallel plan: strategy ddp (launcher: zero3)",
    ]


NAMES = {"ddp", "zero1", "zero2", "zero3", "hsdp", "fsdp", "single"}  # "dp" and "auto" mean other things too
# The tables of layouts the tests and docs use (written as a user writes them) live in tests/layouts/,
# outside src: no runtime module is exempt.


def test_strategy_names_are_spelled_in_one_table():
    spelled = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docstrings:
                spelled.setdefault(path.relative_to(SRC).as_posix(), set()).add(node.value)
    assert set(spelled) == {"config/names.py"}, spelled
