"""The family sweep: transformers models from small configs (Llama tied and untied, Qwen2, Mistral,
Gemma3, GPT-2) in every layout of tests.layouts.families.LAYOUTS, each equal to one process (per-step
loss and torch's own clip_grad_norm_ within 2e-4 relative over 6 steps) or refused at prepare with
the reason the table in docs/models.md quotes. One launch per layout runs every family in turn.

The unmarked test runs a representative subset (tied embeddings under zero3, tp and pp; Gemma3's
own tp plan style; refusals under tp and pp) in one 2-process launch; the whole sweep is marked slow."""

from __future__ import annotations

import pytest

from tests.layouts.families import FAMILIES, LAYOUTS, processes
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]
RTOL = 2e-4


def _cases(layout: str, families: list[str]) -> dict[str, dict]:
    return {f"{name} / {layout}": {"family": name, **LAYOUTS[layout].settings} for name in families}


def _check(ranks: list[dict], name: str, steps: int = 6) -> None:
    family, layout = name.split(" / ")[:2]
    expected = next(f for f in FAMILIES if f.name == family).refused.get(layout)
    for rank in ranks:
        run = rank[name]
        if expected is not None:
            assert expected in run.get("refused", ""), f"{name}: expected a refusal naming {expected!r}, got {run}"
            continue
        assert "refused" not in run, f"{name} was refused: {run['refused']}"
        ref = ranks[0][name]["reference"]
        assert len(run["losses"]) == len(ref["losses"]) == steps
        for what in ("losses", "norms"):
            for step, (got, want) in enumerate(zip(run[what], ref[what]), 1):
                assert abs(got - want) <= RTOL * abs(want), f"{name} {what} step {step}: {got} vs one process {want}"


FAST = {
    **_cases("tp 2", ["llama-tied", "gemma3", "gpt2"]),
    **_cases("pp 2", ["llama-tied", "gpt2"]),
    **_cases("zero3", ["qwen2"]),
    # torch's own utilities on the prepared model: clip_grad_value_, an optimizer built after prepare
    "llama / tp 2 / torch utilities": {
        "family": "llama",
        **LAYOUTS["tp 2"].settings,
        "late_optimizer": True,
        "clip_value": True,
    },
}


@pytest.fixture(scope="module")
def fast() -> list[dict]:
    return run_ranks("tests.dist.family_workloads:matrix", 2, args=(FAST,), timeout=600)


@pytest.mark.parametrize("name", list(FAST))
def test_representative_families_equal_one_process_or_are_refused(fast, name):
    _check(fast, name)


def test_under_tp_the_state_dict_keeps_the_models_own_names(fast):
    from tests.layouts.families import build

    assert fast[0]["llama / tp 2 / torch utilities"]["state_dict"] == sorted(build("llama").state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_family_in_every_layout_equals_one_process_or_is_refused(layout):
    cases = _cases(layout, [f.name for f in FAMILIES])
    ranks = run_ranks("tests.dist.family_workloads:matrix", processes(layout), args=(cases,), timeout=850)
    for name in cases:
        _check(ranks, name)
