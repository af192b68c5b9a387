"""Loops written as torch's and transformers' docs write them, around what `px.prepare` returns, give one
process's result on 2 ranks (issue 51, its silent wrong results). One launch of 2 gloo ranks
(tests/dist/user_surface_workloads.py) for every check; the references run in this process, no phalanx.
"""

import pytest
import torch

from tests.dist import user_surface_workloads as work
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks("tests.dist.user_surface_workloads:suite", 2, timeout=360)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_split_over_workers_is_read_once_as_one_process_reads_it(ranks, workers):
    """torch's docs' get_worker_info() stream on 2 ranks: 4 steps of the same 8 items as one process, the same
    losses and weights (every rank read the whole stream before: 64 items in 8 steps)."""
    reference = work.one_process_stream(workers)
    for rank in ranks:
        got = rank[f"stream-{workers}"]
        assert got["steps"] == reference["steps"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), **TOL)
        for mine, theirs in zip(got["weights"], reference["weights"]):
            torch.testing.assert_close(mine, theirs, **TOL)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_a_scheduler_built_before_prepare_sets_the_lr_phalanx_steps_with(ranks, strategy):
    """get_linear_schedule_with_warmup(opt) before px.prepare(model, opt), not passed: the optimizer phalanx
    steps follows it (under zero1 it kept lr 0.0 while get_last_lr() showed the schedule; weights 0.32 off)."""
    reference = work.one_process_schedule()
    for rank in ranks:
        got = rank[f"schedule-{strategy}"]
        assert got["lrs"] == pytest.approx(reference["lrs"]) and got["shown"] == pytest.approx(reference["shown"])
        for mine, theirs in zip(got["weights"], reference["weights"]):
            torch.testing.assert_close(mine, theirs, **TOL)


@pytest.mark.parametrize("layout", ["ddp", "ep"])
def test_labels_with_uneven_padding_average_over_every_ranks_tokens(ranks, layout):
    """-100 on padded positions, ranks holding 23 and 7 real tokens: the loss is the mean over all tokens, as
    one process's (the ranks' means were averaged: step-0 grad norm 1.6743 against 1.8203 in the issue)."""
    reference = work.one_process_labels("llama" if layout == "ddp" else "moe")
    for rank in ranks:
        got = rank[f"labels-{layout}"]
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(reference[key]), **TOL)
        assert got["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_labels_keep_per_rank_means_when_asked(ranks):
    """average_tokens_across_ranks=False: each rank's mean over its own tokens, averaged over the ranks."""
    rank_means = work.one_process_rank_means()
    assert [rank["labels-rank-means"]["norms"][0] for rank in ranks] == pytest.approx([rank_means] * 2, rel=1e-5)
    assert rank_means != pytest.approx(work.one_process_labels("llama")["norms"][0], rel=1e-3)  # 2.5200 vs 2.0069
