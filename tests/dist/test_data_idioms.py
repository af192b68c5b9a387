"""Data loops as torch's and datasets' docs write them give one process's result on 2 ranks (issue 40).

One launch of 2 gloo ranks (tests/dist/data_idiom_workloads.py) for every check:
- the short last batch of an epoch (DataLoader's drop_last=False): each rank's loss is weighed by its real
  items, padding repeats by none, so grad norms per step and final weights equal one process's;
- a `datasets` stream the script already split with `split_dataset_by_node` is read as it is.
"""

import pytest
import torch

from tests.data_counts import write_jsonl_shards
from tests.dist import data_idiom_workloads as work
from tests.dist.harness import run_ranks

N_STREAM = 22
pytestmark = pytest.mark.slow  # one launch of 2 ranks that import datasets: ~40 s here


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("datasets", reason="the `datasets` extra: pip install phalanx[datasets]")
    folder = tmp_path_factory.mktemp("data-idioms")
    shard_sets = {}
    for strategy, num_shards in (("shards", 2), ("examples", 3)):
        (folder / strategy).mkdir()
        shard_sets[strategy] = write_jsonl_shards(folder / strategy, N_STREAM, num_shards)
    return run_ranks("tests.dist.data_idiom_workloads:suite", 2, args=(shard_sets, str(folder / "cache")), timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("kind", ["map", "stream"])
@pytest.mark.parametrize("loss", ["mean", "sum"])
def test_the_short_last_batch_trains_as_one_process(ranks, kind, loss):
    """19 map-style items or a stream of 17, global batch 8, 2 ranks: the last step's padding repeats
    carried weight (the last grad norm and the weights were off) before."""
    reference = work.one_process(kind, loss == "sum")
    for rank in ranks:
        got = rank[f"{kind}-{loss}"]
        assert len(got["norms"]) == len(reference["norms"])
        # torch's clip_grad_norm_ measures the step's gradients (after num_items' rescale, for a summed loss)
        per_step = ["norms"] if loss == "mean" else ["norms", "losses"]  # a summed loss: px.step_loss, the global mean
        for key in per_step:
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(reference[key]), rtol=2e-4, atol=1e-6)
        for mine, theirs in zip(got["weights"], reference["weights"]):
            torch.testing.assert_close(mine, theirs, rtol=2e-4, atol=1e-6)
    if kind == "map":  # evaluation (model.eval()) keeps the padding: equal shapes on every rank, each item once
        assert ranks[0][f"{kind}-{loss}"]["eval_shapes"] == ranks[1][f"{kind}-{loss}"]["eval_shapes"]
        assert [rank[f"{kind}-{loss}"]["eval_gathered"] for rank in ranks] == [19, 19]  # the map dataset's items


@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", ["shards", "examples"])
def test_a_stream_split_by_the_script_is_not_split_again(ranks, strategy):
    """split_dataset_by_node(ds, rank, world_size) in the script: each rank reads its own split and the job
    reads the stream once per epoch (it was 11 of 22 with "shards"; datasets' own error with "examples")."""
    assert [rank[f"presplit-{strategy}"].get("error") for rank in ranks] == [None, None]
    for epoch in range(work.EPOCHS):
        job = sorted(i for rank in ranks for i in rank[f"presplit-{strategy}"]["read"][epoch])
        assert job == list(range(N_STREAM))
    for rank in ranks:
        assert not [s for s in rank[f"presplit-{strategy}"]["said"] if "item by item" in s]
