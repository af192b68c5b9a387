"""docs/models.md is what tests/layouts/families.py generates, the source the family sweep
(tests/dist/test_families.py) reads: the table cannot claim a cell the tests do not check."""

from __future__ import annotations

from pathlib import Path

from tests.layouts import families

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_committed_models_page_is_what_the_families_module_generates():
    assert PAGE.read_text() == families.page_text(), (
        f"docs/models.md is out of date with tests/layouts/families.py. HINT: run {families.COMMAND}"
    )


def test_every_family_and_layout_has_a_cell_and_every_refusal_its_note():
    text = families.table()
    for fam in families.FAMILIES:
        row = next(line for line in text.splitlines() if line.startswith(f"| {fam.name} "))
        assert row.count("|") == len(families.LAYOUTS) + 3
        for why in fam.refused.values():
            assert f'"{why}"' in text


def test_every_equal_moe_cell_names_a_case_the_expert_parallel_test_runs():
    from tests.dist import test_expert_parallel as ep

    cases = {**ep.CASES, **ep.MORE, **ep.COPIES, **ep.TENSOR}
    for fam in families.MOE_FAMILIES:
        for layout, case in fam.cases.items():
            if case.startswith("pp "):  # test_ep2_under_pp2_equals_one_process: Qwen3-MoE, pp 2 x ep 2, 4 ranks
                assert fam.name == "qwen3_moe" and layout == f"{case.split()[1]} pp 2 x ep 2", (layout, case)
                assert case.split()[1] in ("ddp", "zero3")
                continue
            assert case in cases and cases[case]["family"] == fam.name, (fam.name, layout, case)
            settings = cases[case]["settings"]
            assert f"ep {settings['ep']}" in layout and settings["strategy"] == layout.split()[0], (layout, settings)
            assert ("cp" in layout) == ("cp" in settings) and ("aux" in layout) == ("aux" in cases[case])
            assert ("tp 2" in layout) == (settings.get("tp") == 2) == (case in ep.TENSOR), (layout, settings)
            assert ("copies" in layout or "ep 4" in layout) == (case in ep.COPIES)
