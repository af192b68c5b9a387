"""torchdata's StatefulDataLoader through prepare(): its own state is checkpointed, per rank, and a
mid-epoch resume yields exactly the batches the uninterrupted run went on to read."""

import pytest

from tests.dist.harness import run_ranks


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_yields_the_same_remaining_batches(tmp_path, num_workers):
    ranks = run_ranks(
        "tests.loop.stateful_workloads:save_and_resume", world_size=2, args=(str(tmp_path), num_workers), timeout=240
    )
    for r in ranks:
        assert r["class"] == "StatefulDataLoader"  # rebuilt around phalanx's sampler, same class
        assert r["len"] == 8  # 32 samples / 2 ranks / batch 2
        assert "_num_yielded" in r["saved_keys"] or "_snapshot" in r["saved_keys"]  # torchdata's own state
        assert len(r["rest"]) == 5 + 8  # the rest of epoch 1, then epoch 2
        assert r["again"] == r["rest"]
        assert r["before"] + r["rest"][:5] != r["epoch0"]  # epoch 1 reshuffled
    # The shards stay disjoint and complete.
    shards = [sorted(i for b in r["epoch0"] for i in b) for r in ranks]
    assert sorted(shards[0] + shards[1]) == list(range(32)) and not set(shards[0]) & set(shards[1])
