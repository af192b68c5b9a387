"""Every loader kind of issue #30 on real ranks, counted item by item: 2 ranks, and 2 x 2 (dp 2 x tp 2: the
tp ranks of a pair read the same items). One launch per layout runs all the cases in sequence."""

import os

import pytest

from phalanx.data.loader import PreparedLoader
from phalanx.runtime.context import DistContext
from tests.data_counts import bytes_logged, counts, exact, ids, write_jsonl_shards
from tests.dist.data_workloads import EPOCHS, N, SEED, sampler_loader
from tests.dist.harness import run_ranks

STREAMS = ["shuffling", "sharded_stream", "self_sharding", "hf_datasets"]


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["2 ranks", "2x2 dp x tp"])
def suite(request, tmp_path_factory):
    tp = request.param
    folder = tmp_path_factory.mktemp(f"data-tp{tp}")
    shards = write_jsonl_shards(folder, N, 8)
    log = folder / "log"
    log.mkdir()
    ranks = run_ranks("tests.dist.data_workloads:data_suite", 2 * tp, args=(tp, shards, str(log)), timeout=400)
    return {"tp": tp, "ranks": ranks, "corpus": sum(os.path.getsize(p) for p in shards), "log": str(log)}


def _case(suite, name):
    if name not in suite["ranks"][0]:
        pytest.skip(f"{name} does not run in this layout (or its package is not installed)")
    return [r[name] for r in suite["ranks"]]


@pytest.mark.dist
@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", STREAMS + ["weighted", "replacement"])
def test_each_epoch_is_read_exactly_once_over_the_data_parallel_ranks(suite, name):
    per_rank = _case(suite, name)
    by_dp = {}
    for rank, result in zip(suite["ranks"], per_rank):
        by_dp.setdefault(rank["dp_rank"], []).append(result)
    for group in by_dp.values():  # tp ranks share items
        assert all(r["read"] == group[0]["read"] for r in group)
    expected = 20 if name == "replacement" else N
    for epoch in range(EPOCHS):
        items = [i for group in by_dp.values() for i in group[0]["read"][epoch]]
        if name in ("weighted", "replacement"):  # drawn with replacement: compare with one process below
            assert len(items) == expected
        else:
            assert counts(items, N) == exact(N), (name, epoch)
    steps = [r["steps"] for r in per_rank]
    assert all(s == steps[0] for s in steps)  # gather_for_metrics: the same global step everywhere
    gathered = [i for s in steps[0] for i in s]
    assert len(gathered) == expected * EPOCHS


@pytest.mark.dist
@pytest.mark.timeout(450)
@pytest.mark.parametrize("name", ["weighted", "replacement"])
def test_kept_samplers_give_one_process_global_batches(suite, name):
    """Each global step is the one-process batch of (data-parallel ranks x batch): the draw is not changed."""
    dp = suite["ranks"][0]["dp_size"]
    one = PreparedLoader(sampler_loader(name, 4 * dp), DistContext(), seed=SEED)
    reference = [sorted(ids(b)) for _ in range(EPOCHS) for b in one]
    assert _case(suite, name)[0]["steps"] == reference


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_a_sharded_stream_reads_the_corpus_once_in_the_job(suite):
    _case(suite, "sharded_stream")
    # Every rank's workers logged the bytes they read, over both epochs; tp ranks each read their pair's shards.
    assert bytes_logged(suite["log"]) == suite["corpus"] * EPOCHS * suite["tp"]


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_nested_eval_and_zipped_loaders_keep_their_own_counts(suite):
    for nested in _case(suite, "nested"):
        assert counts(nested["trained"], 37) == {"total": 74, "distinct": 37, "duplicated": 37, "missing": 0}
        n_steps = len(nested["trained"]) and 5  # 5 train steps per epoch, each with one eval pass of 10
        assert len(nested["evaluated"]) == 10 * n_steps * EPOCHS
    for zipped in _case(suite, "zip"):
        assert sorted(zipped["a"]) == list(range(37)) and sorted(zipped["b"]) == list(range(100, 117))


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_save_and_load_state_continue_each_loader_kind(suite):
    dp = suite["ranks"][0]["dp_size"]
    for r in _case(suite, "resume"):
        assert r["again"] == r["rest"] and len(r["done"] + r["rest"]) == N // 4 // dp  # the saved draw, continued
        assert r["after_left"] == r["next_epoch"]  # left after 3 batches: the next epoch, whole
        assert [len(e) for e in r["stateful_epochs"]] == [N // dp] * 2  # not an empty epoch first
    one_per_dp = {r["dp_rank"]: r for r in suite["ranks"]}.values()
    for epoch in range(2):
        assert counts([i for r in one_per_dp for i in r["resume"]["stateful_epochs"][epoch]], N) == exact(N)


@pytest.mark.dist
@pytest.mark.timeout(450)
def test_a_sampler_generator_seeded_per_rank_is_refused_with_the_fix(suite):
    for message in _case(suite, "rank_seeded"):
        assert "in a different state on each rank" in message and "HINT: seed it the same on every rank" in message
