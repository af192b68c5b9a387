"""The same seed gives the same initial weights in every layout, with `px.init_module()` or without:
a transformers Llama with a peft LoRA adapter built on meta under zero3 (and tp 2) and materialised at
prepare equals, bitwise, the same model built in one process with no phalanx (LoRA's A included), and
the generator is left where one process's construction leaves it."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

CASES = {"zero3": {"strategy": "zero3"}, "tp 2": {"strategy": "ddp", "tp": 2}}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks("tests.dist.init_workloads:matrix", 2, args=(CASES,), timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_init_module_builds_one_process_weights(ranks, name):
    run = ranks[0][name]
    assert run["on_meta"]  # built on meta, materialised at prepare
    assert run["differ"] == [], (
        f"{len(run['differ'])} of {run['count']} tensors differ from one process: {run['differ'][:5]}"
    )
    assert run["next_draw_equal"]
