"""Activation checkpointing under zero2 and zero3 equals one process with no phalanx: the optimizer,
made from model.parameters() before px.prepare, was refused ("the optimizer holds a parameter of
shape (16, 16) that belongs to no model prepared by 'zero3'": the checkpoint wrappers renamed the
parameters FSDP2 replaced)."""

import pytest
import torch

from tests.dist import ac_workloads as work
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_activation_checkpointing_under_zero2_and_zero3_equals_one_process():
    reference = work.one_process()
    ranks = run_ranks("tests.dist.ac_workloads:checkpointed", 2, args=(["zero2", "zero3"],), timeout=240)
    for rank in ranks:
        for strategy in ("zero2", "zero3"):
            got = rank[strategy]
            assert "refused" not in got, got
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=2e-4, atol=1e-6
            )
    for key, value in reference["weights"].items():  # the main process holds the full weights
        for strategy in ("zero2", "zero3"):
            torch.testing.assert_close(ranks[0][strategy]["weights"][key], value, rtol=2e-4, atol=1e-6, msg=key)
