"""docs/optimizers.md is what the code's classification generates (strategies/optimizers/optimizer_kinds.py,
routed over the presets' layouts), so the table cannot drift from what prepare does."""

from __future__ import annotations

from pathlib import Path

from tests.layouts import optimizers as optimizer_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "optimizers.md"


def test_the_committed_page_is_what_the_classification_generates():
    assert PAGE.read_text() == optimizer_table.table_text(), (
        f"docs/optimizers.md is out of date with src/phalanx/strategies/optimizers/optimizer_kinds.py. "
        f"HINT: run {optimizer_table.COMMAND}"
    )


def test_the_table_says_muon_steps_whole_under_zero3_and_lbfgs_is_refused_there():
    text = optimizer_table.table_text()
    header = next(line for line in text.splitlines() if line.startswith("| optimizer |")).split(" | ")
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| `torch")}
    zero3 = header.index("zero3")
    assert rows["| `torch.optim.Muon`"][zero3] == "**whole, on an owner**"
    assert rows["| `torch.optim.AdamW`"][zero3] == "slices"
    assert rows["| `torch.optim.LBFGS`"][zero3] == "refused"


def test_main_writes_the_page(tmp_path):
    out = tmp_path / "optimizers.md"
    assert optimizer_table.main([str(out)]) == 0 and out.read_text() == optimizer_table.table_text()
