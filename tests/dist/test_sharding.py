"""Prepared loaders: disjoint and complete shards, per-epoch reshuffling, exact metric gathering."""

import pytest

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def shuffled_101():
    return run_ranks("tests.dist.workloads:indices_seen", 2, args=(101, 8, True, False, 3))


def test_shards_are_disjoint_and_complete_up_to_padding(shuffled_101):
    r0, r1 = (r["per_epoch"][0] for r in shuffled_101)
    assert len(r0) == len(r1) == 51  # 101 samples padded to 102
    assert set(r0) | set(r1) == set(range(101))
    assert len(set(r0) & set(r1)) == 1, "exactly one repeated sample pads the odd dataset"


def test_every_rank_has_the_same_number_of_batches(shuffled_101):
    assert shuffled_101[0]["num_batches"] == shuffled_101[1]["num_batches"] == [7, 7, 7]


def test_gather_for_metrics_returns_exactly_the_dataset(shuffled_101):
    for result in shuffled_101:
        for gathered in result["gathered"]:
            assert len(gathered) == 101
            assert sorted(gathered) == list(range(101))


def test_each_epoch_reshuffles_without_set_epoch(shuffled_101):
    epochs = shuffled_101[0]["per_epoch"]
    assert epochs[0] != epochs[1] != epochs[2]
    for r0, r1 in zip(shuffled_101[0]["per_epoch"], shuffled_101[1]["per_epoch"]):
        assert set(r0) | set(r1) == set(range(101))


def test_unshuffled_eval_keeps_order_per_rank_and_counts_each_item_once():
    results = run_ranks("tests.dist.workloads:indices_seen", 2, args=(101, 4, False, False, 1))
    assert results[0]["per_epoch"][0] == list(range(0, 101, 2))
    assert results[1]["per_epoch"][0] == list(range(1, 101, 2)) + [0]
    assert sorted(results[0]["gathered"][0]) == list(range(101))


@pytest.fixture(scope="module")
def collective_results():
    return run_ranks("tests.dist.workloads:collectives", 2)


def test_collectives(collective_results):
    r0, r1 = collective_results
    for r in (r0, r1):
        assert r["mean"].item() == 1.5
        assert r["sum"].item() == 3.0
        assert r["gather"].tolist() == [0, 0, 1, 1]
        assert r["gather_scalar"].tolist() == [0.0, 1.0]
        assert r["gather_ragged"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert r["gather_nested"][0].tolist() == [0, 1]
        assert r["gather_nested"][1]["k"].tolist() == [0, 10]
        assert r["objects"] == ["pred-0", "pred-1"]
        assert r["device"] == "cpu"
    assert (r0["is_main"], r1["is_main"]) == (True, False)


def test_print_only_on_main(collective_results):
    r0, r1 = collective_results
    assert (r0["printed"], r1["printed"]) == ("hello 0\n", "")
