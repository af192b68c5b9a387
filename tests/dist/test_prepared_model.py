"""The prepared model answers the user's module's methods in every layout (issue 40): generate,
config, save_pretrained; each compared with the same module in one process, no phalanx."""
import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_generate_on_the_prepared_model_equals_one_process(strategy):
    results = run_ranks("tests.dist.prepared_model_workloads:generate", 2, args=({"strategy": strategy},),
                        timeout=240)
    for r in results:
        assert r["vocab"] == 64 and r["has_save_pretrained"]
        assert torch.equal(r["got"], r["expected"])
