"""The prepared model answers the user's module's methods in every layout (issue 40): generate,
config, save_pretrained; each compared with the same module in one process, no phalanx."""

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_generate_on_the_prepared_model_equals_one_process(strategy):
    results = run_ranks("tests.dist.prepared_model_workloads:generate", 2, args=({"strategy": strategy},), timeout=240)
    for r in results:
        assert r["vocab"] == 64 and r["has_save_pretrained"]
        assert torch.equal(r["got"], r["expected"])


@pytest.mark.parametrize("settings", [{"strategy": "zero3"}, {"strategy": "ddp", "tp": 2}], ids=["zero3", "tp2"])
def test_save_pretrained_on_every_rank_writes_one_process_model(settings, tmp_path):
    r0, _ = run_ranks(
        "tests.dist.prepared_model_workloads:save_pretrained",
        2,
        args=(settings, str(tmp_path / "saved"), True),
        timeout=240,
    )
    assert r0["keys"]
    assert r0["max_rel"] < 2e-4


def test_save_pretrained_on_one_rank_is_refused_naming_get_state_dict(tmp_path):
    r0, _ = run_ranks(
        "tests.dist.prepared_model_workloads:save_pretrained",
        2,
        args=({"strategy": "zero3"}, str(tmp_path / "saved"), False),
        timeout=240,
    )
    assert r0["refused"] and "px.get_state_dict" in r0["refused"] and "every rank" in r0["refused"]
    # the refused call is counted on no rank: the next call, on every rank, meets and writes the model
    assert r0["keys"] and r0["max_rel"] < 2e-4, r0
