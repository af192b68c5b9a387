"""docs/compatibility.md is what tests/layouts/compatibility.py generates, the list the
composition matrix test (tests/dist/test_compatibility.py) reads: the page cannot claim a cell the
tests do not check."""
from __future__ import annotations

from pathlib import Path

from tests.layouts import compatibility, layout

PAGE = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def test_the_committed_compatibility_page_is_what_the_module_generates():
    assert PAGE.read_text() == compatibility.page_text(), (
        f"docs/compatibility.md is out of date with tests/layouts/compatibility.py. "
        f"HINT: run {compatibility.COMMAND}")


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
    assert compatibility.main([str(out)]) == 0 and out.read_text() == compatibility.page_text()
