"""Seeding: identical global RNGs on every rank, distinct reproducible DataLoader worker streams."""

import pytest
import torch

from tests.dist.harness import run_ranks

TARGET = "tests.loop.seed_workloads:streams_and_training"


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_worker_streams_differ_across_ranks_and_runs_reproduce():
    first = run_ranks(TARGET, world_size=2, args=(3,), timeout=300)
    second = run_ranks(TARGET, world_size=2, args=(3,), timeout=300)

    for epoch in (0, 1):
        workers = {(r["rank"], w): s for r in first for (e, w), s in r["streams"].items() if e == epoch}
        assert sorted(workers) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for source in ("torch", "numpy", "random"):
            draws = [tuple(s[source]) for s in workers.values()]
            assert all(len(d) == 4 for d in draws)  # 8 samples per rank, batch 2, 2 workers
            assert len(set(draws)) == 4, f"{source}: two workers drew the same stream in epoch {epoch}"
            flat = [x for d in draws for x in d]
            assert len(set(flat)) == len(flat), f"{source}: a value repeats across workers"
        # The sampler still shards one shared permutation: disjoint and complete.
        indices = [i for s in workers.values() for i in s["index"]]
        assert sorted(indices) == list(range(16))
        assert all(all(s["init_ran"]) for s in workers.values())  # the user's worker_init_fn ran
    # A new epoch draws new numbers in every worker.
    r0 = first[0]["streams"]
    assert r0[(0, 0)]["torch"] != r0[(1, 0)]["torch"]

    # Same seed, same everything, bit for bit.
    for a, b in zip(first, second):
        assert a["streams"] == b["streams"]
        for key in a["final"]:
            assert torch.equal(a["final"][key], b["final"][key])
    # Model init identical on both ranks before DDP's broadcast; ranks end equal.
    for key in first[0]["init"]:
        assert torch.equal(first[0]["init"][key], first[1]["init"][key])
        assert torch.equal(first[0]["final"][key], first[1]["final"][key])


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("persistent,stream", [(False, False), (True, False), (False, True)])
def test_mid_epoch_resume_with_workers_is_exact(tmp_path, persistent, stream):
    """Samples augmented in 2 workers per rank (map-style, or a stream that the resumed run reads
    again up to its position): saved after 2 steps of epoch 1 and resumed, the run sees the same
    augmented inputs and ends with the same weights, bit for bit."""
    results = run_ranks(
        "tests.loop.seed_workloads:resume_with_workers",
        world_size=2,
        args=(str(tmp_path), persistent, stream),
        timeout=300,
    )
    for r in results:
        assert len(r["straight"]) == 8 and len(r["before"]) == 6 and len(r["after"]) == 2
        for seen, expected in zip(r["before"] + r["after"], r["straight"]):
            assert torch.equal(seen, expected)
        for key in r["weights"]:
            assert torch.equal(r["weights"][key], r["resumed"][key])
