"""Equal step counts for any size/batch/drop_last, pre-split data, uneven user loops: nothing hangs."""

import itertools

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.uneven_workloads import BATCH_SIZES, SIZES

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

KINDS = ("map", "sampler", "iterable")
CASES = list(itertools.product(KINDS, SIZES, BATCH_SIZES, (False, True)))


@pytest.fixture(scope="module")
def matrix():
    """One launch: every dataset size x batch size x drop_last x loader kind (ddp training on 'map')."""
    return run_ranks("tests.dist.uneven_workloads:size_matrix", 2, args=(KINDS,), timeout=200)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_both_ranks_take_the_same_number_of_batches(matrix, case):
    r0, r1 = matrix[0][case], matrix[1][case]
    assert r0["steps"] == r1["steps"]
    if r0["len"] is not None:
        assert r0["len"] == r1["len"] == r0["steps"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_gather_for_metrics_counts_each_item_once(matrix, case):
    kind, n, batch, drop_last = case
    r0, r1 = matrix[0][case], matrix[1][case]
    assert r0["gathered"] == r1["gathered"]
    if not drop_last:
        assert sorted(r0["gathered"]) == list(range(n))
        assert set(r0["seen"]) | set(r1["seen"]) == set(range(n))
    else:  # full batches only, no repeats
        per_rank = (n // 2) // batch if kind != "iterable" else r0["steps"]
        assert r0["steps"] == per_rank
        assert len(r0["gathered"]) == len(set(r0["gathered"])) == 2 * per_rank * batch


def test_expected_batch_counts(matrix):
    # DistributedSampler arithmetic: 101 samples -> 51 per rank (padded) or 50 (dropped).
    assert matrix[0][("map", 101, 4, False)]["steps"] == 13
    assert matrix[0][("map", 101, 4, True)]["steps"] == 12
    assert matrix[0][("map", 1, 32, False)]["steps"] == 1
    assert matrix[0][("map", 1, 32, True)]["steps"] == 0
    assert matrix[0][("iterable", 1000, 1, False)]["steps"] == 500


def test_ddp_training_over_the_matrix_kept_ranks_identical(matrix):
    for a, b in zip(matrix[0]["params"], matrix[1]["params"]):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_iterable_dataset_is_sharded_over_ranks_and_workers():
    r0, r1 = run_ranks("tests.dist.uneven_workloads:iterable_workers", 2, args=(103, 4, 2), timeout=120)
    assert not set(r0["seen"]) & set(r1["seen"]), "an item reached both ranks"
    assert len(r0["seen"]) == len(set(r0["seen"])), "two workers of one rank read the same item"
    assert sorted(r0["seen"] + r1["seen"]) == list(range(103))
    assert sorted(r0["gathered"]) == list(range(103))


# ddp and zero1 (Join through DDP and the sharded optimizer), zero3 (FSDP2: step agreement).
STRATEGIES = ["ddp", "zero1", "zero3"]
JOINABLE = {"ddp", "zero1"}


@pytest.fixture(scope="module", params=STRATEGIES)
def presplit(request):
    return run_ranks("tests.dist.uneven_workloads:presplit_suite", 2, args=(request.param,), timeout=150)


def test_presplit_5_and_4_batches_pad_to_5_and_keep_every_item(presplit):
    r0, r1 = (r["pad"] for r in presplit)
    assert (r0["steps"], r1["steps"], r0["len"], r1["len"]) == (5, 5, 5, 5)
    expected = list(range(20)) + list(range(1000, 1016))
    assert sorted(r0["gathered"]) == sorted(r1["gathered"]) == expected
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def test_presplit_with_drop_last_stops_both_ranks_at_4(presplit):
    r0, r1 = (r["drop"] for r in presplit)
    assert (r0["steps"], r1["steps"]) == (4, 4)
    assert sorted(r0["gathered"]) == list(range(16)) + list(range(1000, 1016))


def test_presplit_data_prepared_with_sharding_warns_and_stays_even(presplit):
    r0, r1 = (r["resharded"] for r in presplit)
    assert r0["steps"] == r1["steps"] == 3
    for r in (r0, r1):
        assert len(r["warnings"]) == 1
        assert "different length on each rank (by rank: [20, 16])" in r["warnings"][0]
        assert "shard=False" in r["warnings"][0]
    assert not presplit[0]["pad"]["warnings"]


@pytest.fixture(scope="module", params=STRATEGIES)
def user_loops(request):
    strategy = request.param
    methods = ("auto", "join", "agree") if strategy in JOINABLE else ("auto", "agree")
    return strategy, run_ranks("tests.dist.uneven_workloads:user_loop_suite", 2, args=(strategy, methods), timeout=150)


def test_join_trains_every_batch_and_syncs_the_final_model(user_loops):
    strategy, results = user_loops
    if strategy not in JOINABLE:  # FSDP2 models are not Joinable: join() explains
        assert "torch's Join needs Joinable models" in results[0]["join_error"]
        assert "HINT: use px.uneven_inputs(model)" in results[0]["join_error"]
        return
    assert results[0]["join_error"] is None
    for method in ("auto", "join"):
        r0, r1 = (r[method] for r in results)
        assert (r0["method"], r0["steps"], r1["steps"]) == ("join", 5, 4)
        for a, b in zip(r0["params"], r1["params"]):
            assert torch.equal(a, b)


def test_join_of_the_model_alone_takes_in_its_prepared_optimizer(user_loops):
    """px.uneven_inputs(model) under zero1 hung: the sharded optimizer's all-gather was not in the Join."""
    strategy, results = user_loops
    if strategy not in JOINABLE:
        return
    r0, r1 = (r["model_only"] for r in results)
    assert (r0["method"], r0["steps"], r1["steps"]) == ("join", 5, 4)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def test_fsdp2_rank_out_of_data_steps_on_batches_of_no_rows(user_loops):
    """zero3's auto stopped both ranks at 4 steps (rank 0's 5th batch never trained); now rank 1 runs
    a 5th step on no rows (zero gradients, FSDP2's collectives met) and the ranks end as one model."""
    strategy, results = user_loops
    if strategy in JOINABLE:
        return
    r0, r1 = (r["auto"] for r in results)
    assert (r0["method"], r0["steps"], r1["steps"], r1["rows"]) == ("shadow", 5, 5, 16)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def test_step_agreement_stops_every_rank_together(user_loops):
    strategy, results = user_loops
    for method in ("agree",):
        r0, r1 = (r[method] for r in results)
        assert (r0["method"], r0["steps"], r1["steps"]) == ("agree", 4, 4)
        for a, b in zip(r0["params"], r1["params"]):
            assert torch.equal(a, b)
