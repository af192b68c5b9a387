"""The composition matrix: every cell of tests.layouts.compatibility.CELLS (layout x model x
features) equals the same loop in plain torch/transformers in one process with no phalanx, on the
same global batches (per-step loss and clipped norm within 2e-4 relative over 6 steps, final weights
allclose; looser with bf16: see BF16_TOLERANCE) or is refused at prepare with the reason the cell
names; docs/compatibility.md is generated from the same list. phalanx's own world of one (no layout:
`python train.py`) equals that plain loop bitwise (test_world_of_one_is_plain_torch_bitwise).

The references run in one launch of one process; the cells in one launch per process count (a
preemption stops a run with SystemExit in the middle of the launch; the next cell's Phalanx() starts
afresh, and its preemption agrees under store keys of its own: preemption/worker.py). The unmarked
test runs a representative subset; the whole matrix is marked slow."""

from __future__ import annotations

import pytest
import torch

from tests.layouts import layout
from tests.layouts.compatibility import CELLS, Cell, cell
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]
WORKLOADS = "tests.dist.compat_workloads"


def _reference_key(c: Cell) -> tuple[str, tuple[str, ...]]:
    return c.model, tuple(f for f in c.features if f not in ("resume", "preempt", "ac", "compile"))


def run_matrix(cells: list[Cell], tmp: str) -> tuple[dict, dict[str, list[dict]]]:
    """(references by key, each cell's per-rank results)."""
    keys = sorted({_reference_key(c) for c in cells if c.refused is None})
    refs = run_ranks(f"{WORKLOADS}:plain_references", 1, args=(keys,), timeout=600)[0]
    results: dict[str, list[dict]] = {}
    for processes in (2, 4):
        group = [c for c in cells if layout(c.layout).processes == processes]
        if not group:
            continue
        ranks = run_ranks(
            f"{WORKLOADS}:cells", processes, args=([c.name for c in group], tmp), timeout=900, local_world_size=2
        )
        for c in group:
            results[c.name] = [rank[c.name] for rank in ranks]
    return refs, results


def check(c: Cell, refs: dict, ranks: list[dict]) -> None:
    for rank in ranks:
        if c.refused is not None:
            assert c.refused in rank.get("refused", ""), (
                f"{c.name}: expected a refusal naming {c.refused!r}, got {rank}"
            )
            continue
        assert "refused" not in rank, f"{c.name} was refused: {rank['refused']}"
        ref = refs[_reference_key(c)]
        if "preempt" in c.features:
            assert rank["exit"] == 143
        if "compile" in c.features:
            assert rank["graphs"] > 0, f"{c.name}: torch.compile captured no graph: the run was eager"
        for what in ("losses", "norms"):
            assert len(rank[what]) == len(ref[what]), f"{c.name} {what}: {rank[what]} vs one process {ref[what]}"
            for step, (got, want) in enumerate(zip(rank[what], ref[what]), 1):
                assert abs(got - want) <= c.tolerance[what] * abs(want), (
                    f"{c.name} {what} step {step}: {got} vs one process {want}"
                )
    if c.refused is None:
        state, want, tol = ranks[0]["state"], refs[_reference_key(c)]["state"], c.tolerance
        assert sorted(state) == sorted(want), c.name
        for key in want:
            if "weights_atol" in tol:
                torch.testing.assert_close(
                    state[key],
                    want[key],
                    rtol=tol["weights"],
                    atol=tol["weights_atol"],
                    msg=lambda m, key=key: f"{c.name} {key}: {m}",
                )
            else:  # bf16: tensor by tensor
                off = (state[key] - want[key]).norm() / want[key].norm().clamp_min(1e-12)
                assert off <= tol["weights"], f"{c.name} {key}: off by {off:.3g} of its norm"


FAST = [
    cell(name)
    for name in (
        "zero3 / llama / num_items+clip+accum2",
        "tp 2 / llama / bf16+clip",
        "pp 2 / llama-lora / clip",
        "ddp / cnn-bn / clip",
        "pp 2 / cnn-bn / clip",
        "zero1 / llama / clip+resume from ddp",
        "pp 2 / llama / clip+preempt",
        "tp 2 / llama / clip+preempt",
        "zero3 / llama / ac+clip",
        "zero2 / llama / compile+clip",
        "tp 2 / llama / compile+clip",
    )
]


BITWISE = [("llama", ("clip",)), ("llama-lora", ("clip",)), ("cnn-bn", ("clip",)), ("llama", ("bf16", "clip"))]
"""loops whose phalanx world of one computes what the plain loop computes, operation for operation.
With num_items phalanx rescales the summed gradients at the step (Σ ∇loss · 1/Σn) where the plain loop
divides each loss before its backward: equal within 2e-4 (the matrix), not in the last bits."""


def test_world_of_one_is_plain_torch_bitwise():
    """Phalanx() with no layout (`python train.py`), px.forward_backward, px.clip_grad_norm_, px.get_state_dict:
    the same losses, norms and final weights, bit for bit, as the loop in plain torch/transformers."""
    result = run_ranks(f"{WORKLOADS}:world_of_one", 1, args=(BITWISE,), timeout=600)[0]
    for key, both in result.items():
        got, want = both["phalanx"], both["plain"]
        assert got["losses"] == want["losses"] and got["norms"] == want["norms"], (key, got, want)
        assert sorted(got["state"]) == sorted(want["state"]), key
        for name, value in want["state"].items():
            assert torch.equal(got["state"][name], value), (key, name)


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> tuple[dict, dict]:
    return run_matrix(FAST, str(tmp_path_factory.mktemp("compat")))


@pytest.mark.parametrize("name", [c.name for c in FAST])
def test_representative_cells_equal_one_process_or_are_refused(fast, name):
    refs, results = fast
    check(cell(name), refs, results[name])


@pytest.mark.slow
def test_every_cell_of_the_matrix_equals_one_process_or_is_refused(tmp_path):
    refs, results = run_matrix(list(CELLS), str(tmp_path))
    failed = []
    for c in CELLS:
        try:
            check(c, refs, results[c.name])
        except AssertionError as error:
            failed.append(f"{c.name}: {str(error)[:300]}")
    assert not failed, "\n".join(failed)
