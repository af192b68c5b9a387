"""split_batches: the loader's batch_size is the global batch, divided over the data-parallel ranks.

Pure: each rank's PreparedLoader is built from an explicit context, no processes needed."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from phalanx.data.loader import PreparedLoader
from phalanx.data.split_batches import not_dividing_message, per_rank_batch_size
from phalanx.runtime.context import DistContext
from phalanx.strategies.plan.parallel_plan import ParallelPlan


def split_loaders(world: int, batch_size: int = 12, n: int = 48, **ctx_kw) -> list[PreparedLoader]:
    data = TensorDataset(torch.arange(n))
    return [
        PreparedLoader(
            DataLoader(data, batch_size=batch_size, shuffle=True),
            DistContext(rank=rank, world_size=world, **ctx_kw),
            seed=7,
            split_batches=True,
        )
        for rank in range(world)
    ]


def steps(per_rank: list[PreparedLoader]) -> list[list[int]]:
    """Each global step's samples (all ranks' batches, sorted), one pass."""
    return [sorted(i for (b,) in batches for i in b.tolist()) for batches in zip(*per_rank)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_gets_its_part_and_the_global_batches_are_the_same_on_any_world_size(world):
    per_rank = split_loaders(world)
    assert [loader.batch_size for loader in per_rank] == [12 // world] * world
    assert steps(per_rank) == steps(split_loaders(1))  # the same 12 samples in every step
    assert [len(b) for (b,) in per_rank[0]] == [12 // world] * 4


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_on_three_without_changing_the_script():
    saved_on = split_loaders(2)
    reference = steps(split_loaders(2))
    iters = [iter(loader) for loader in saved_on]
    for _ in range(2):
        for it in iters:
            next(it)
    state = saved_on[0].state_dict()
    assert state == {"epoch": 0, "unit": "samples", "consumed": 24, "world_size": 2, "global_batch": 12}
    for world in (1, 3):
        resumed = split_loaders(world)
        for loader in resumed:
            loader.load_state_dict(state)
        assert steps(resumed) == reference[2:]  # the next global batches, nothing repeated or lost


def test_without_split_batches_the_same_resume_is_refused_and_the_hint_names_split_batches():
    """A script written for 2 ranks x 6 (no split_batches), resumed on 1 rank: its global batch halves."""
    saved_on = [
        PreparedLoader(
            DataLoader(TensorDataset(torch.arange(48)), batch_size=6, shuffle=True),
            DistContext(rank=r, world_size=2),
            seed=7,
        )
        for r in range(2)
    ]
    plain = PreparedLoader(
        DataLoader(TensorDataset(torch.arange(48)), batch_size=6, shuffle=True), DistContext(), seed=7
    )
    with pytest.raises(ValueError, match=r"global batch changed.*set split_batches with batch_size = 12"):
        plain.load_state_dict(saved_on[0].state_dict())


def test_a_global_batch_that_does_not_divide_is_refused_with_the_sizes_that_do():
    with pytest.raises(ValueError) as error:
        split_loaders(3, batch_size=10)
    assert str(error.value) == (
        "split_batches: the DataLoader's batch_size 10 is the global batch and does not divide over 3 "
        "data-parallel ranks. HINT: use batch_size 9 (3 per rank) or 12 (4 per rank), or run on a number "
        "of ranks that divides 10 (1, 2, 5, 10)"
    )


def test_a_global_batch_smaller_than_the_ranks_offers_only_the_size_above():
    assert (
        "HINT: use batch_size 4 (1 per rank), or run on a number of ranks that divides 3 (1, 3)"
        in not_dividing_message(3, 4)
    )


def test_what_has_no_global_batch_is_refused_with_the_fix():
    data = TensorDataset(torch.arange(8))
    with pytest.raises(ValueError, match=r"shard=False.*no global batch to split"):
        per_rank_batch_size(8, 2, shard=False)
    with pytest.raises(ValueError, match=r"no batch_size \(a custom batch_sampler"):
        PreparedLoader(DataLoader(data, batch_sampler=[[0, 1], [2, 3]]), DistContext(), split_batches=True)


def test_a_custom_sampler_splits_its_global_batch():
    """A sampler phalanx keeps is dealt index by index: a step's global batch is one batch of its draw."""
    data = TensorDataset(torch.arange(8))
    order = [7, 6, 5, 4, 3, 2, 1, 0]
    steps = [
        [
            sorted(b[0].tolist())
            for b in PreparedLoader(
                DataLoader(data, batch_size=4, sampler=order), DistContext(rank=r, world_size=2), split_batches=True
            )
        ]
        for r in range(2)
    ]
    assert [sorted(a + b) for a, b in zip(*steps)] == [[4, 5, 6, 7], [0, 1, 2, 3]]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(16))


def test_a_stream_is_read_in_per_rank_batches():
    loaders = [
        PreparedLoader(DataLoader(Stream(), batch_size=4), DistContext(rank=r, world_size=2), split_batches=True)
        for r in range(2)
    ]
    # the rebuilt DataLoader itself: iterating the PreparedLoader needs a process group (ranks agree per step)
    assert [[b.tolist() for b in lo.loader] for lo in loaders] == [
        [[0, 2], [4, 6], [8, 10], [12, 14]],
        [[1, 3], [5, 7], [9, 11], [13, 15]],
    ]


def test_the_data_parallel_size_and_rank_come_from_the_context_not_the_world():
    """Ranks of one tensor-parallel group (same dp rank) read the same batches."""
    tp_pairs = [
        DistContext(rank=r, world_size=4).with_data_parallel(ParallelPlan(preset="ddp", dp_replicate=2, tp=2))
        for r in range(4)
    ]
    data = TensorDataset(torch.arange(48))
    per_rank = [
        PreparedLoader(DataLoader(data, batch_size=12, shuffle=True), c, seed=7, split_batches=True) for c in tp_pairs
    ]
    batches = [[b.tolist() for (b,) in loader] for loader in per_rank]
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    assert [len(b) for b in batches[0]] == [6] * 4  # 12 over 2 data-parallel ranks, not over 4 ranks
    for loader in per_rank:
        loader.set_epoch(0)  # the pass above was epoch 0: compare that one
    assert steps([per_rank[0], per_rank[2]]) == steps(split_loaders(1))
    with pytest.raises(ValueError, match="does not divide over 2 data-parallel ranks"):
        PreparedLoader(DataLoader(data, batch_size=7), tp_pairs[0], split_batches=True)
