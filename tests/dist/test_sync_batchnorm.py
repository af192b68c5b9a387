"""`sync_batchnorm=True`: BatchNorm statistics over both ranks' samples, on CPU over gloo, so 2 ranks
equal one process on the global batch (weights and running statistics); without it they do not."""

import pytest
import torch

from tests.dist import batchnorm_workloads as w
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

CASES = {
    "ddp": {"strategy": "ddp", "sync_batchnorm": True},
    "zero3": {"strategy": "zero3", "sync_batchnorm": True},
    "ddp_unsynced": {"strategy": "ddp", "sync_batchnorm": False},
}


@pytest.fixture(scope="module")
def runs() -> dict:
    return {
        "ranks": run_ranks("tests.dist.batchnorm_workloads:matrix", 2, args=(CASES,), timeout=240),
        "reference": w.reference(),
    }


@pytest.mark.parametrize("case", ["ddp", "zero3"])
def test_synced_batchnorm_on_two_cpu_ranks_equals_one_process(runs, case):
    result = runs["ranks"][0][case]
    assert result["kinds"] == {"synced": 2, "unsynced": []}
    assert result["warned"] == []
    assert result["state"].keys() == runs["reference"].keys()  # same state dict as the BatchNorm model
    for key, value in runs["reference"].items():
        torch.testing.assert_close(
            result["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )


def test_unsynced_batchnorm_differs_from_one_process(runs):
    result = runs["ranks"][0]["ddp_unsynced"]
    assert result["kinds"] == {"synced": 0, "unsynced": ["1 (BatchNorm2d)", "5 (BatchNorm1d)"]}
    ref = runs["reference"]
    assert not torch.allclose(result["state"]["1.running_var"], ref["1.running_var"], rtol=1e-3)
    assert not torch.allclose(result["state"]["7.weight"], ref["7.weight"], rtol=1e-3)


def test_unsynced_batchnorm_under_a_data_parallel_layout_is_said_once_at_prepare_with_the_setting(runs):
    """Per-rank statistics are what torch's DDP does too, but silently unlike one process (issue 51):
    the main process says so once, naming the layers and sync_batchnorm; other ranks say nothing."""
    main, other = (r["ddp_unsynced"]["warned"] for r in runs["ranks"])
    assert len(main) == 1 and other == [], (main, other)
    assert "1 (BatchNorm2d), 5 (BatchNorm1d)" in main[0] and "sync_batchnorm=True" in main[0], main[0]
