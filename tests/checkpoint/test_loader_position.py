"""PreparedLoader's data position: saved as a global count, resumed with the very next batch on any
world size. Pure: each rank's loader is built from an explicit context, no processes needed."""

import weakref
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from phalanx.data.loader import PreparedLoader
from phalanx.runtime.context import DistContext


class EpochBatches:
    """A custom batch sampler (shuffled per epoch via set_epoch, as DistributedSampler is)."""

    def __init__(self, n: int, size: int):
        self.n, self.size, self.epoch = n, size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(3 + self.epoch)).tolist()
        return iter([order[i : i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self) -> int:
        return -(-self.n // self.size)


def loaders(world: int, n: int = 48, global_batch: int = 12, custom: bool = False) -> list[PreparedLoader]:
    data = TensorDataset(torch.arange(n))
    out = []
    for rank in range(world):
        if custom:  # a batch sampler phalanx cannot rebuild index-wise: whole batches are dealt out
            loader = DataLoader(data, batch_sampler=EpochBatches(n, 4))
        else:
            loader = DataLoader(data, batch_size=global_batch // world, shuffle=True)
        out.append(PreparedLoader(loader, DistContext(rank=rank, world_size=world), seed=7))
    return out


_OPEN: "weakref.WeakKeyDictionary[PreparedLoader, Any]" = weakref.WeakKeyDictionary()


def global_steps(per_rank: list[PreparedLoader], num_steps: int | None = None) -> list[list[int]]:
    """The samples of each global step (all ranks' batches of that step, sorted), one pass.

    A pass stopped after `num_steps` stays open, as a training loop's iterator does while it saves
    (a pass whose iterator is dropped is left: its position becomes the next epoch's start)."""
    iters = [_OPEN.pop(loader, None) or iter(loader) for loader in per_rank]
    steps = []
    while num_steps is None or len(steps) < num_steps:
        try:
            batches = [next(it)[0].tolist() for it in iters]
        except StopIteration:
            return steps
        steps.append(sorted(i for b in batches for i in b))
    for loader, it in zip(per_rank, iters):
        _OPEN[loader] = it
    return steps


def epoch_steps(world: int, epoch: int, **kw) -> list[list[int]]:
    per_rank = loaders(world, **kw)
    for loader in per_rank:
        loader.set_epoch(epoch)
    return global_steps(per_rank)


@pytest.mark.parametrize("resume_world", [1, 2, 3])
def test_mid_epoch_resume_continues_with_the_next_global_batch(resume_world):
    reference = [epoch_steps(2, 0), epoch_steps(2, 1)]
    saved_on = loaders(2)
    global_steps(saved_on)  # epoch 0, whole
    consumed = global_steps(saved_on, 2)  # epoch 1: two steps in
    assert consumed == reference[1][:2]
    states = [loader.state_dict() for loader in saved_on]
    assert states[0] == states[1], "the position is global: every rank saves the same"
    assert states[0] == {"epoch": 1, "unit": "samples", "consumed": 24, "world_size": 2, "global_batch": 12}
    resumed = loaders(resume_world)
    for loader in resumed:
        loader.load_state_dict(states[0])
    assert global_steps(resumed) == reference[1][2:]  # the rest of epoch 1, nothing repeated or lost
    assert global_steps(resumed) == epoch_steps(resume_world, 2)  # then epoch 2 whole


def test_custom_batch_sampler_resumes_with_the_next_batches():
    """Whole batches are dealt round-robin: 2 ranks x 2 steps = 4 batches done; 1 rank resumes at the 5th."""
    saved_on = loaders(2, custom=True)
    done = global_steps(saved_on, 2)
    state = saved_on[0].state_dict()
    assert state == {"epoch": 0, "unit": "batches", "consumed": 4, "world_size": 2, "global_batch": 2}
    (alone,) = loaders(1, custom=True)
    alone.load_state_dict(state)
    rest = [batch[0].tolist() for batch in alone]
    assert [sorted(b) for b in rest] == [sorted(b) for b in EpochBatches(48, 4)][4:]
    assert sorted(i for b in done + rest for i in b) == list(range(48))
    with pytest.raises(ValueError, match="not a whole number of steps of 3 batches"):
        loaders(3, custom=True)[0].load_state_dict(state)


def test_position_after_the_last_batch_is_the_start_of_the_next_epoch():
    per_rank = loaders(2)
    assert len(global_steps(per_rank, 4)) == 4  # all 4 steps of epoch 0 yielded, loop not yet left
    assert per_rank[0].state_dict() == {
        "epoch": 1,
        "unit": "samples",
        "consumed": 0,
        "world_size": 2,
        "global_batch": 12,
    }


def test_changed_global_batch_is_refused_with_the_fix():
    saved_on = loaders(2, global_batch=12)
    global_steps(saved_on, 1)
    other = loaders(2, global_batch=16)[0]
    with pytest.raises(
        ValueError,
        match=r"global batch changed.*12 samples per step \(2 ranks x 6\), this run takes "
        r"16 \(2 ranks x 8\).*batch_size = 12 / world_size = 6",
    ):
        other.load_state_dict(saved_on[0].state_dict())


def test_two_ranks_of_16_then_one_rank_of_16_is_refused_and_one_rank_of_32_resumes():
    """The resume contract: the world size and strategy may change; the global batch may not."""
    saved_on = loaders(2, global_batch=32, n=128)
    global_steps(saved_on, 2)
    state = saved_on[0].state_dict()
    with pytest.raises(
        ValueError,
        match=r"32 samples per step \(2 ranks x 16\), this run takes 16 \(1 rank x 16\)"
        r".*batch_size = 32 / world_size = 32",
    ):
        loaders(1, global_batch=16, n=128)[0].load_state_dict(state)
    (alone,) = loaders(1, global_batch=32, n=128)
    alone.load_state_dict(state)
    assert len(list(alone)) == 2  # 4 steps of 32 per epoch, 2 done


def torch_batch_sampler_loaders(world: int, n: int = 40, global_batch: int = 8) -> list[PreparedLoader]:
    """The script's own `BatchSampler(RandomSampler(data, generator=...), global_batch // world)`, as
    `batch_sampler=` (the idiom corpus's batch-sampler loop), one loader per rank."""
    data = TensorDataset(torch.arange(n))
    out = []
    for rank in range(world):
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(5))
        loader = DataLoader(data, batch_sampler=BatchSampler(sampler, global_batch // world, drop_last=False))
        out.append(PreparedLoader(loader, DistContext(rank=rank, world_size=world), seed=7))
    return out


def one_process_steps(n: int = 40, global_batch: int = 8, epochs: int = 2) -> list[list[int]]:
    """The same loop in plain torch, one process: every step's samples, sorted, over `epochs` epochs."""
    data = TensorDataset(torch.arange(n))
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(5))
    loader = DataLoader(data, batch_sampler=BatchSampler(sampler, global_batch, drop_last=False))
    return [sorted(batch[0].tolist()) for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("saved_world,resume_world", [(2, 1), (1, 2)])
def test_a_torch_batch_sampler_resumes_on_another_world_size_as_one_process(saved_world, resume_world):
    """Saved 2 steps into epoch 1 (of 2, 5 steps each): the resumed run reads the 3 steps left and then no
    more, each step one process's. 2 -> 1 read 8 steps where one process reads 10 (16 of 40 items skipped);
    1 -> 2 resumed 1 step too early (its samples read twice)."""
    reference = one_process_steps()
    saved_on = torch_batch_sampler_loaders(saved_world)
    done = global_steps(saved_on) + global_steps(saved_on, 2)  # epoch 0 whole, then 2 steps of epoch 1
    state = saved_on[0].state_dict()
    resumed = torch_batch_sampler_loaders(resume_world)
    for loader in resumed:
        loader.load_state_dict(state)
    assert done + global_steps(resumed) == reference
    assert state["unit"] == "samples" and state["consumed"] == 16 and state["global_batch"] == 8
