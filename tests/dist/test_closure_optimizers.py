"""An optimizer that calls the closure several times and reads its loss (LBFGS with a strong-Wolfe
line search; a user's undeclared optimizer that does the same) under ddp on 2 ranks, each with half
the global batch, written as torch's docs write LBFGS: every rank takes one process's step (losses
and final weights within 2e-4 of one process on the whole batch) and no rank hangs."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


@pytest.mark.parametrize("which, max_iter", [("lbfgs", 5), ("lbfgs", 20), ("loss_reading", 1)])
def test_a_closure_optimizer_under_ddp_takes_one_process_step(which, max_iter):
    """max_iter 20 (torch's default): the ranks used to part and hang."""
    ranks = run_ranks("tests.dist.closure_workloads:train", 2, args=(which, 3, max_iter), timeout=120)
    reference = ranks[0]["reference"]
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=2e-4, atol=1e-6)
        for name, value in reference["state"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=2e-4, atol=1e-6, msg=f"{which} {name}")
