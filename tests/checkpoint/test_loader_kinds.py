"""Every loader kind users bring, counted item by item against one process (issue #30).

Pure: each rank's PreparedLoader is built from an explicit context in this process (map-style data
needs no collective), so many world sizes run in a second. Streams and the facade run on real ranks
in tests/dist/test_data_kinds.py.
"""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, TensorDataset, WeightedRandomSampler

from phalanx.data.batch_records import BatchRecords
from phalanx.data.loader import PreparedLoader
from phalanx.runtime.context import DistContext
from tests.data_counts import counts, exact, ids

N = 40
DATA = TensorDataset(torch.arange(N))


class Shuffled(Sampler[int]):
    """A custom random sampler with its own generator, as users write them."""

    def __init__(self, n: int, seed: int):
        self.n, self.generator = n, torch.Generator().manual_seed(seed)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def __len__(self) -> int:
        return self.n


def random_replacement():
    return RandomSampler(DATA, replacement=True, num_samples=20, generator=torch.Generator().manual_seed(5))


def weighted(generator=True):
    weights = torch.linspace(0.1, 1.0, N)
    return WeightedRandomSampler(weights, N, generator=torch.Generator().manual_seed(9) if generator else None)


SAMPLERS = {
    "random_replacement": random_replacement,
    "weighted": weighted,
    "weighted_global_rng": lambda: weighted(False),
    "custom": lambda: Shuffled(N, 4),
}


def prepared(world: int, sampler_of, global_batch: int = 8) -> list[PreparedLoader]:
    """One loader per rank of `world`; split_batches keeps the global batch on any world size."""
    return [
        PreparedLoader(
            DataLoader(DATA, batch_size=global_batch, sampler=sampler_of()),
            DistContext(rank=r, world_size=world),
            seed=3,
            split_batches=True,
        )
        for r in range(world)
    ]


class Run:
    """Ranks stepping together through epochs, as a training loop does; iterators stay open between calls."""

    def __init__(self, loaders: list[PreparedLoader]):
        self.loaders, self.iters = loaders, None

    def steps(self, num: int) -> list[list[int]]:
        out = []
        while len(out) < num:
            if self.iters is None:
                self.iters = [iter(loader) for loader in self.loaders]
            try:
                batches = [ids(next(it)) for it in self.iters]
            except StopIteration:
                self.iters = None
                continue
            out.append(sorted(i for b in batches for i in b))
        return out


def test_random_sampler_with_replacement_keeps_its_draw():
    """20 draws with replacement from the user's generator, as plain torch draws them; 2 ranks share them out."""
    torch_draw = [ids(b) for b in DataLoader(DATA, batch_size=8, sampler=random_replacement())]
    steps = Run(prepared(2, random_replacement)).steps(3)
    assert steps == [sorted(b) for b in torch_draw]
    assert counts([i for s in steps for i in s], N)["total"] == 20  # not a 40-item shuffle


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("world", [2, 4])
def test_a_kept_sampler_on_n_ranks_equals_one_process_step_by_step(kind, world):
    one = Run(prepared(1, SAMPLERS[kind])).steps(15)  # 3 epochs
    assert Run(prepared(world, SAMPLERS[kind])).steps(15) == one
    assert one[:5] != one[5:10] or kind == "random_replacement"  # each epoch draws anew


@pytest.mark.parametrize("kind", ["weighted", "weighted_global_rng", "custom"])
def test_a_random_sampler_resumed_continues_the_epochs_draw(kind):
    """Saved at step 3 on 2 ranks, resumed on 2: the rest of the epoch is the saved draw's, not a new one."""
    reference = Run(prepared(2, SAMPLERS[kind])).steps(10)
    first = Run(prepared(2, SAMPLERS[kind]))
    done = first.steps(3)
    state = first.loaders[0].state_dict()
    resumed = Run(prepared(2, SAMPLERS[kind]))
    for loader in resumed.loaders:
        loader.load_state_dict(state)
    assert done + resumed.steps(7) == reference


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_world_size_changes_4_2_1_2_resume_exactly(kind):
    """Steps over 3 epochs on 4, then 2, then 1, then 2 ranks equal one process's; no item dropped or repeated."""
    reference = Run(prepared(1, SAMPLERS[kind])).steps(15)
    got, state = [], None
    for world, num in ((4, 3), (2, 4), (1, 4), (2, 4)):
        run = Run(prepared(world, SAMPLERS[kind]))
        if state is not None:
            for loader in run.loaders:
                loader.load_state_dict(state)
        got += run.steps(num)
        state = run.loaders[0].state_dict()
    assert got == reference
    if kind != "random_replacement":
        for epoch in range(3):
            assert counts([i for s in got[5 * epoch : 5 * epoch + 5] for i in s], N)["total"] == N


class Batches:
    """A custom batch sampler: random batches of 4 from its own generator."""

    def __init__(self, seed: int = 2):
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        order = torch.randperm(N, generator=self.generator).tolist()
        return iter([order[i : i + 4] for i in range(0, N, 4)])

    def __len__(self) -> int:
        return N // 4


def batch_loaders(world: int) -> list[PreparedLoader]:
    return [
        PreparedLoader(DataLoader(DATA, batch_sampler=Batches()), DistContext(rank=r, world_size=world), seed=3)
        for r in range(world)
    ]


def test_custom_batch_sampler_resumes_its_draw_and_refuses_a_split_step_with_the_right_hint():
    reference = Run(batch_loaders(2)).steps(10)  # 2 epochs of 5 steps (2 batches each)
    first = Run(batch_loaders(2))
    done = first.steps(2)
    state = first.loaders[0].state_dict()
    assert state["consumed"] == 4 and "draw" in state
    resumed = Run(batch_loaders(2))
    for loader in resumed.loaders:
        loader.load_state_dict(state)
    assert done + resumed.steps(8) == reference
    on_four = Run(batch_loaders(4))
    for loader in on_four.loaders:  # 4 batches done: a whole step on 4 ranks as well
        loader.load_state_dict(state)
    rest = on_four.steps(2)  # 6 batches left in the epoch: 1 full step, 1 with 2 padding batches (repeats)
    before, after = {i for s in done for i in s}, {i for s in rest for i in s}
    assert len(before) == 16 and after - before == set(range(N)) - before
    with pytest.raises(ValueError, match=r"not a whole number of steps of 3 batches.*resume on 1, 2 or 4 ranks"):
        batch_loaders(3)[0].load_state_dict(state)


def test_an_epoch_left_early_resumes_at_the_next_epoch():
    (loader,) = prepared(1, lambda: Shuffled(N, 4))
    for step, _ in enumerate(loader):
        if step == 2:
            break
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0
    reference = Run(prepared(1, lambda: Shuffled(N, 4))).steps(10)[5:]
    (again,) = prepared(1, lambda: Shuffled(N, 4))
    again.load_state_dict(loader.state_dict())
    assert [sorted(ids(b)) for b in again] == reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_saved_on_an_epochs_last_batch_goes_on_with_the_next_epoch(num_workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PreparedLoader(
                StatefulDataLoader(DATA, batch_size=8, shuffle=True, num_workers=num_workers), DistContext(), seed=1
            )

    first = make()
    it = iter(first)
    for _ in range(5):  # the epoch's last batch, the loop not yet left
        next(it)
    state, own = first.state_dict(), first.stateful_state().state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.stateful_state().load_state_dict(own)
    epochs = [[i for b in resumed for i in ids(b)] for _ in range(2)]
    assert [counts(e, N) for e in epochs] == [exact(N)] * 2  # 10 steps, not 5


def test_nested_and_zipped_loaders_keep_their_own_padding_records():
    """Rank 1 of 2 over 37 items holds 1 padding sample per epoch; an eval loop inside must not hide it."""
    records = BatchRecords()
    ctx = DistContext(rank=1, world_size=2)
    train = PreparedLoader(DataLoader(TensorDataset(torch.arange(37)), batch_size=19), ctx, batch_records=records)
    evals = PreparedLoader(DataLoader(TensorDataset(torch.arange(10)), batch_size=5), ctx, batch_records=records)
    real = []
    for _ in range(2):
        for _ in train:
            for _ in evals:
                assert records.current() is evals.batch_info
            real.append(records.current().num_real)
    assert real == [18, 18]  # 37 = 19 + 18 on each epoch: 74 items over 2 epochs, not 76
    for a, _ in zip(train, evals):
        assert (a is not None, train.batch_info.num_real, evals.batch_info.num_real) == (True, 18, 5)
