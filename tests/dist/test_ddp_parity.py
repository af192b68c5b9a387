"""2-rank DDP training equals one process on the same global batches."""

import pytest
import torch

from tests.dist import workloads
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def test_two_ranks_equal_single_process_on_the_same_global_batches():
    reference = workloads.train(global_batch=16, epochs=2)
    results = run_ranks("tests.dist.workloads:train", 2, args=(16, 2))
    assert [r["strategy"] for r in results] == ["ddp", "ddp"]
    assert reference["strategy"] == "single"
    assert len(results[0]["losses"]) == len(reference["losses"]) == 8
    for name, expected in reference["state"].items():
        torch.testing.assert_close(results[0]["state"][name], expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(results[0]["state"][name], results[1]["state"][name]), "ranks diverged"
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5
    )
