"""The idiom corpus (tests/idioms/corpus.py) across every layout, against the same loops in plain
torch/transformers in one process with no phalanx: each cell is what tests/idioms/table.py declares
(equal, refused with the message it names, or a known failure, expected strictly), the table
docs/compatibility.md shows. One spawn of ranks per process count runs every idiom of its layouts;
ddp's cells are the first tier, the rest the second (slow)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.harness import run_ranks
from tests.idioms.check import outcome
from tests.idioms.corpus import SCRIPTS, write_shards
from tests.idioms.table import EQUAL, EXPECTED, IDIOMS, LAYOUTS, Failing, Refused, layouts_of

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]
FIRST_TIER = ["ddp"]
SECOND_TIER_2 = [name for name in layouts_of(2) if name not in FIRST_TIER]
SECOND_TIER_4 = layouts_of(4)


def _spawn(layouts: list[str], root: str) -> dict[Any, Any]:
    """Every idiom under `layouts` in one spawn: {"references": ..., (layout, idiom): [rank results]}."""
    write_shards(root)
    processes = LAYOUTS[layouts[0]].processes
    ranks = run_ranks(
        "tests.idioms.workloads:cells", processes, args=(layouts, list(SCRIPTS), root), timeout=1200, local_world_size=2
    )
    out: dict[Any, Any] = {"references": {k: v for rank in ranks for k, v in rank["references"].items()}}
    for layout in layouts:
        for idiom in SCRIPTS:
            out[(layout, idiom)] = [rank[(layout, idiom)] for rank in ranks]
    return out


def check_cell(spawned: dict[Any, Any], layout: str, idiom: str) -> None:
    ranks = spawned[(layout, idiom)]
    references = spawned["references"]
    key = (idiom, ranks[0].get("dp_size")) if idiom == "uneven-reduce" else idiom
    want = references.get(key)  # None for a refused cell (no dp_size)
    got, why = outcome(ranks, want)
    declared = EXPECTED[(idiom, layout)]
    if isinstance(declared, Failing):
        assert got != EQUAL, f"{idiom} / {layout} now equals one process: declare it equal in tests/idioms/table.py"
        pytest.xfail(f"known: {declared.measured} (measured now: {got}: {why})")
    if isinstance(declared, Refused):
        assert isinstance(got, Refused) and declared.says in got.says, (
            f"{idiom} / {layout}: expected a refusal saying {declared.says!r}, got {got}: {why}"
        )
        assert "HINT" in got.says, got.says
        return
    assert got == EQUAL, f"{idiom} / {layout}: {got}: {why}"


def test_every_cell_is_declared() -> None:
    assert set(EXPECTED) == {(idiom, layout) for idiom in IDIOMS for layout in LAYOUTS}
    assert set(IDIOMS) == set(SCRIPTS)
    assert set(FIRST_TIER + SECOND_TIER_2 + SECOND_TIER_4) == set(LAYOUTS)


@pytest.fixture(scope="module")
def first_tier(tmp_path_factory) -> dict[Any, Any]:
    return _spawn(FIRST_TIER, str(tmp_path_factory.mktemp("idioms")))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[Any, Any]:
    return _spawn(SECOND_TIER_2, str(tmp_path_factory.mktemp("idioms")))


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> dict[Any, Any]:
    return _spawn(SECOND_TIER_4, str(tmp_path_factory.mktemp("idioms")))


@pytest.mark.parametrize("idiom", list(SCRIPTS))
def test_idiom_under_ddp_is_as_declared(first_tier, idiom: str) -> None:
    check_cell(first_tier, "ddp", idiom)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SECOND_TIER_2)
@pytest.mark.parametrize("idiom", list(SCRIPTS))
def test_idiom_on_two_processes_is_as_declared(two_processes, layout: str, idiom: str) -> None:
    check_cell(two_processes, layout, idiom)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SECOND_TIER_4)
@pytest.mark.parametrize("idiom", list(SCRIPTS))
def test_idiom_on_four_processes_is_as_declared(four_processes, layout: str, idiom: str) -> None:
    check_cell(four_processes, layout, idiom)
