"""docs/compatibility.md is what tests/layouts/compatibility.py and tests/idioms/table.py
generate (tests/idioms/page.py), the lists the composition matrix test (tests/dist/test_compatibility.py)
and the idiom corpus (tests/idioms/test_corpus.py) read: the page cannot claim a cell the tests do not
check."""

from __future__ import annotations

from pathlib import Path

from tests.idioms import page, table
from tests.layouts import compatibility, layout

PAGE = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def test_the_committed_compatibility_page_is_what_the_module_generates():
    assert PAGE.read_text() == page.page_text(), (
        f"docs/compatibility.md is out of date with tests/layouts/compatibility.py or tests/idioms/table.py. "
        f"HINT: run {compatibility.COMMAND}"
    )


def test_the_page_shows_every_idiom_under_every_layout_with_cp_and_a_mixture_of_experts():
    text = PAGE.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| idiom |"))
    assert all(f" {layout} |" in header for layout in table.LAYOUTS) and "cp 2 x dp 2" in header
    for idiom in table.IDIOMS:
        assert f"| `{idiom}` |" in text
    assert "Qwen3-MoE" in text


def test_every_layout_tests_every_feature_in_some_cell():
    """Each feature in some cell of every layout, each model in every layout: the only gaps are the
    known bugs PENDING names (and the page shows)."""
    pending = {(what, where) for where, what, _ in compatibility.PENDING}
    for each in compatibility.LAYOUTS:
        tested = {f for c in compatibility.CELLS if c.layout == each.name for f in c.features}
        for feature in compatibility.FEATURES:
            assert feature in tested or (feature, each.name) in pending, (feature, each.name)
        models = {c.model for c in compatibility.CELLS if c.layout == each.name}
        for model in compatibility.MODELS:
            assert model in models or (model, each.name) in pending, (model, each.name)


def test_a_resume_comes_from_another_layout_of_the_same_size():
    for c in compatibility.CELLS:
        if "resume" in c.features:
            assert c.resume_from != c.layout
            assert layout(c.resume_from).processes == layout(c.layout).processes


def test_main_writes_the_page(tmp_path):
    out = tmp_path / "compatibility.md"
    assert page.main([str(out)]) == 0 and out.read_text() == page.page_text()
