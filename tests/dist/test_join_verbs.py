"""Inside `px.uneven_inputs(model)` under ddp and zero1 (torch's Join): px.reduce, px.gather and
px.log work over the ranks still stepping, and every rank's chunk keeps being stepped; compared
with the same loop in one process, no phalanx (issue 40)."""

import pytest
import torch

from tests.dist import join_verbs_workloads as work
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_uneven_inputs_with_reduce_gather_log_equal_one_process(strategy):
    ref = work.reference()
    results = run_ranks("tests.dist.join_verbs_workloads:uneven_loop", 2, args=(strategy,), timeout=240)
    for rank, r in enumerate(results):
        steps = work.NUM_BATCHES[rank]
        assert len(r["reduced"]) == len(r["gathered"]) == steps
        for t in range(steps):
            active = ref["losses"][t]
            torch.testing.assert_close(r["reduced"][t], sum(active) / len(active), rtol=2e-4, atol=1e-6)
            torch.testing.assert_close(r["gathered"][t], active, rtol=2e-4, atol=1e-6)
        torch.testing.assert_close(r["norms"], ref["norms"][:steps], rtol=2e-4, atol=1e-6)
        for got, want in zip(r["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_zero3_rank_out_of_data_steps_on_no_rows_and_reduces_over_the_others():
    """zero3 (FSDP2, not Joinable) inside px.uneven_inputs: the rank out of batches runs the loop on
    batches of no rows, so its shard keeps being stepped; px.reduce / px.gather there are over the
    ranks with a batch, and every rank's clip norm and final weights are one process's (was: both
    ranks stopped at the shortest, rank 0's last batches untrained)."""
    ref = work.reference()
    steps = max(work.NUM_BATCHES)
    for r in run_ranks("tests.dist.join_verbs_workloads:uneven_loop", 2, args=("zero3",), timeout=240):
        assert len(r["reduced"]) == len(r["gathered"]) == steps
        for t in range(steps):
            active = ref["losses"][t]
            torch.testing.assert_close(r["reduced"][t], sum(active) / len(active), rtol=2e-4, atol=1e-6)
            torch.testing.assert_close(r["gathered"][t], active, rtol=2e-4, atol=1e-6)
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=2e-4, atol=1e-6)
        for got, want in zip(r["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_zero1_keeps_stepping_a_finished_ranks_chunk():
    """zero1 alone inside px.uneven_inputs: the rank out of batches still steps its chunk of every
    parameter with its peers' gradients, so the weights equal one process's (and ddp's)."""
    ref = work.reference()
    for r in run_ranks("tests.dist.join_verbs_workloads:uneven_loop", 2, args=("zero1", False), timeout=240):
        for got, want in zip(r["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_the_epoch_after_an_uneven_one_starts_from_one_optimizer_schedule_and_gradient():
    """After Join every rank holds the last joiner's optimizer and scheduler state and gradients, as
    DDP gives it the last joiner's weights: the next epoch equals one process (was: the early rank
    kept AdamW's moments and its LambdaLR count from 3 steps, not 5, and the shadowed all-reduces'
    results in its .grad: the next epoch's first grad norm read 0.781 against 0.638)."""
    ref = work.two_epochs_reference()
    for r in run_ranks("tests.dist.join_verbs_workloads:two_epochs", 2, args=("ddp",), timeout=240):
        torch.testing.assert_close(r["lr"], ref["lr"], rtol=1e-6, atol=0)
        for got, want in zip(r["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_a_scheduled_zero1_optimizer_inside_join_is_refused_naming_ddp():
    """zero1's finished rank steps its chunk with a learning rate its scheduler no longer moves:
    the weights parted from one process's by 0.01 before this refusal."""
    for r in run_ranks("tests.dist.join_verbs_workloads:two_epochs", 2, args=("zero1",), timeout=240):
        assert r["refused"].startswith("phalanx: px.uneven_inputs under zero1"), r
        assert "no longer moves" in r["refused"] and "HINT: run the uneven loop under strategy ddp" in r["refused"]
