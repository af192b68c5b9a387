"""Cells of the idiom corpus that were known failures, each in a spawn of its own with only the
layouts and idioms it needs (the whole corpus is test_corpus.py's second tier):
- `uneven-reduce` under FSDP2 (zero2, zero3, hsdp 2 x 2): `px.uneven_inputs` stopped every rank at
  the shortest one (16 of 20 items trained, 16 of 32 under hsdp; weights 12-15% off torch's Join).
  A rank out of data now runs on batches of no rows (data/shadow_batches.py).
- `short-last-batch` under hsdp 2 x 2: the rank whose last batch is all padding counted its one
  repeated item (20 of 19).
- `uneven-reduce` under pp 2 x ddp 2: the step-level agreement stopped both replicas at the shorter
  one's data; `px.uneven_inputs` is now refused at the call, naming even shards as the way out."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist.harness import run_ranks
from tests.idioms.check import outcome
from tests.idioms.corpus import write_shards
from tests.idioms.table import EQUAL, LAYOUTS, Refused

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def _cells(layouts: list[str], idioms: list[str], root: str) -> dict[tuple[str, str], Any]:
    """{(layout, idiom): (outcome, what differs, items per data-parallel rank)} of one spawn."""
    write_shards(root)
    ranks = run_ranks(
        "tests.idioms.workloads:cells",
        LAYOUTS[layouts[0]].processes,
        args=(layouts, idioms, root),
        timeout=500,
        local_world_size=2,
    )
    references = {k: v for rank in ranks for k, v in rank["references"].items()}
    out = {}
    for layout in layouts:
        for idiom in idioms:
            cell = [rank[(layout, idiom)] for rank in ranks]
            key = (idiom, cell[0].get("dp_size")) if idiom == "uneven-reduce" else idiom
            got, why = outcome(cell, references.get(key))  # None for a refused cell
            out[(layout, idiom)] = got, why, {r.get("dp_rank"): r.get("items") for r in cell}
    return out


@pytest.mark.slow
def test_uneven_inputs_under_zero2_and_zero3_trains_every_item_as_join(tmp_path) -> None:
    cells = _cells(["zero2", "zero3"], ["uneven-reduce"], str(tmp_path))
    for layout in ("zero2", "zero3"):
        got, why, items = cells[(layout, "uneven-reduce")]
        assert sum(items.values()) == 20, (layout, items)  # 12 + 8: every rank's batches, as Join trains them
        assert got == EQUAL, f"{layout}: {got}: {why}"


@pytest.mark.slow
def test_hsdp_trains_every_uneven_item_and_counts_the_short_last_batch_exactly(tmp_path) -> None:
    cells = _cells(["hsdp 2 x 2"], ["uneven-reduce", "short-last-batch"], str(tmp_path))
    got, why, items = cells[("hsdp 2 x 2", "uneven-reduce")]
    assert sum(items.values()) == 32 and got == EQUAL, f"{got}: {why} ({items})"
    got, why, items = cells[("hsdp 2 x 2", "short-last-batch")]
    assert sum(items.values()) == 19 and got == EQUAL, f"{got}: {why} ({items})"  # the padded rank counts 0


@pytest.mark.slow
def test_uneven_inputs_under_pp_x_ddp_is_refused_at_the_call(tmp_path) -> None:
    cells = _cells(["pp 2 x ddp 2"], ["uneven-reduce"], str(tmp_path))
    got, why, _ = cells[("pp 2 x ddp 2", "uneven-reduce")]
    assert isinstance(got, Refused), f"{got}: {why}"
    assert "px.uneven_inputs under pipeline parallel with 2 data-parallel replicas" in got.says, got.says
    assert "HINT: give every data-parallel rank as many batches" in got.says, got.says
