"""The script's own DistributedSampler handed to prepare: taken over (re-pointed at the data-parallel
ranks), never sharded a second time. Pure: each rank's PreparedLoader from an explicit context."""

import logging

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from phalanx.data.loader import PreparedLoader
from phalanx.data.rank_sampler import TakenOverSampler, shards_by_rank
from phalanx.runtime.context import DistContext

N = 64


def script_loaders(contexts, n=N, batch_size=4, sampler_cls=DistributedSampler, **sampler_kw):
    """What a torchrun script builds on each of 2 processes, prepared under `contexts` (one per rank)."""
    data = TensorDataset(torch.arange(n))
    users = [sampler_cls(data, num_replicas=len(contexts), rank=r, **sampler_kw) for r in range(len(contexts))]
    return users, [
        PreparedLoader(DataLoader(data, batch_size=batch_size, sampler=users[r]), ctx, seed=0)
        for r, ctx in enumerate(contexts)
    ]


def one_pass(loader):
    return [i for (b,) in loader for i in b.tolist()]


DDP = [DistContext(rank=r, world_size=2) for r in range(2)]
TP2 = [DistContext(rank=r, world_size=2, dp_rank=0, dp_size=1) for r in range(2)]  # one tp group of 2


def test_under_ddp_every_sample_is_seen_once_per_epoch_and_each_rank_takes_half():
    users, loaders = script_loaders(DDP)
    for epoch in range(2):
        for user in users:
            user.set_epoch(epoch)
        seen = [one_pass(loader) for loader in loaders]
        assert [len(s) for s in seen] == [N // 2, N // 2]  # sharded twice, each rank read 16
        assert sorted(seen[0] + seen[1]) == list(range(N))


def test_under_tp2_both_tensor_parallel_ranks_read_the_same_rows_and_all_of_them():
    _, loaders = script_loaders(TP2)
    seen = [one_pass(loader) for loader in loaders]
    assert seen[0] == seen[1]
    assert sorted(seen[0]) == list(range(N))


def test_set_epoch_on_the_scripts_own_sampler_gives_torchs_order_for_that_epoch():
    users, loaders = script_loaders(DDP, shuffle=True, seed=3)
    for user in users:
        user.set_epoch(5)
    expected = DistributedSampler(TensorDataset(torch.arange(N)), num_replicas=2, rank=1, shuffle=True, seed=3)
    expected.set_epoch(5)
    assert one_pass(loaders[1]) == list(expected)


def test_without_set_epoch_the_prepared_loader_still_reshuffles_each_pass():
    _, loaders = script_loaders(DDP, shuffle=True)
    assert one_pass(loaders[0]) != one_pass(loaders[0])


def test_shuffle_seed_and_drop_last_are_the_scripts():
    users, loaders = script_loaders(DDP, n=51, shuffle=False, drop_last=True)
    seen = [one_pass(loader) for loader in loaders]
    assert seen == [list(range(0, 50, 2)), list(range(1, 50, 2))]  # in order, the odd sample dropped


def test_eval_padding_is_counted_so_every_sample_counts_once():
    """51 eval samples on 2 ranks: DistributedSampler pads one repeat, which is not counted as real, and is
    cut from the short last batch that holds it (no padding repeat is trained on, issue 40)."""
    _, loaders = script_loaders(DDP, n=51, shuffle=False)
    assert sum(loader.loader.sampler.num_real_samples for loader in loaders) == 51
    assert [len(one_pass(loader)) for loader in loaders] == [26, 25]


class Reversed(DistributedSampler):
    """A subclass with its own order: kept, only re-pointed."""

    def __iter__(self):
        return iter(list(super().__iter__())[::-1])


class OwnShards:
    """No DistributedSampler at all, but splits by rank (a sampler copied from some repository)."""

    def __init__(self, data, num_replicas, rank):
        self.data, self.num_replicas, self.rank = data, num_replicas, rank

    def __iter__(self):
        return iter(range(self.rank, len(self.data), self.num_replicas))

    def __len__(self):
        return len(range(self.rank, len(self.data), self.num_replicas))


def test_a_subclass_keeps_its_order_and_a_duck_typed_rank_sampler_is_recognised():
    _, loaders = script_loaders(TP2, sampler_cls=Reversed, shuffle=False)
    assert one_pass(loaders[0]) == list(range(N))[::-1]
    data = TensorDataset(torch.arange(N))
    assert shards_by_rank(OwnShards(data, 2, 0)) and not shards_by_rank(torch.utils.data.RandomSampler(data))
    prepared = PreparedLoader(DataLoader(data, batch_size=4, sampler=OwnShards(data, 2, 1)), TP2[1], seed=0)
    assert one_pass(prepared) == list(range(N))


class Recorded(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_one_line_says_what_was_done():
    logger, recorded = logging.getLogger("phalanx.data"), Recorded()
    level = logger.level
    logger.addHandler(recorded)
    logger.setLevel(logging.INFO)
    try:
        _, loaders = script_loaders(TP2[:1], shuffle=True, seed=4)
    finally:
        logger.removeHandler(recorded)
        logger.setLevel(level)
    lines = [line for line in recorded.lines if "took over" in line]
    assert lines == [
        "prepare() took over the script's DistributedSampler(shuffle=True, seed=4, drop_last=False): "
        "it now splits the data over the 1 data-parallel rank instead of being split a second time; "
        "set_epoch on it still sets the epoch"
    ]
    assert isinstance(loaders[0].sampler, TakenOverSampler)


def test_the_tp_line_says_the_script_counted_every_process():
    data = TensorDataset(torch.arange(8))
    user = DistributedSampler(data, num_replicas=2, rank=0)
    assert "it counted 2 processes" in TakenOverSampler(user, 1, 0).describe(1)


def test_set_epoch_through_the_prepared_loaders_sampler_counts_too():
    """Seed 003 writes `trainloader.sampler.set_epoch(ep)` on the loader prepare returned."""
    _, loaders = script_loaders(DDP, shuffle=True, seed=3)
    loaders[0].sampler.set_epoch(7)
    first, again = one_pass(loaders[0]), one_pass(loaders[0])
    expected = DistributedSampler(TensorDataset(torch.arange(N)), num_replicas=2, rank=0, shuffle=True, seed=3)
    expected.set_epoch(7)
    assert first == again == list(expected)  # the chosen epoch holds until the script chooses again
