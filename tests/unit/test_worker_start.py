"""start_workers' pieces in one process: which Pythons and loaders it guards, the handshake, the draws it
puts back. The stuck worker itself is tests/dist/test_worker_start.py."""

import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from phalanx.data import worker_start
from phalanx.data.worker_start import fork_can_hang, forks_workers, start_workers


@pytest.mark.parametrize(
    "version, hangs",
    [
        ((3, 10, 14), True),
        ((3, 11, 7), True),
        ((3, 11, 9), True),
        ((3, 11, 10), False),
        ((3, 12, 0), False),
        ((3, 13, 1), False),
    ],
)
def test_the_pythons_with_the_fork_deadlock(version, hangs):
    assert fork_can_hang(version, "cpython") is hangs
    assert fork_can_hang(version, "pypy") is False


def _loader(**kwargs):
    return DataLoader(TensorDataset(torch.arange(12)), batch_size=3, **kwargs)


def test_only_forked_workers_are_guarded():
    assert not forks_workers(_loader())
    assert not forks_workers(_loader(num_workers=1, multiprocessing_context="spawn"))
    assert not forks_workers(_loader(num_workers=1, multiprocessing_context="forkserver"))
    assert forks_workers(_loader(num_workers=1, multiprocessing_context="fork"))


def _mark(flags_and_seen, worker_id):
    flags_and_seen[worker_id] = 10 + worker_id


def test_a_guarded_pass_reads_everything_and_runs_the_users_worker_init(monkeypatch):
    monkeypatch.setattr(worker_start, "FORK_CAN_HANG", True)
    seen = multiprocessing.RawArray("b", 2)
    user_init = lambda worker_id: _mark(seen, worker_id)  # noqa: E731 (a fork needs no pickling)
    loader = _loader(num_workers=2, multiprocessing_context="fork", worker_init_fn=user_init)
    it = start_workers(loader, timeout=30)
    assert loader.worker_init_fn is user_init  # the marking wrapper is only in the workers
    assert sorted(int(i) for batch in it for i in batch[0]) == list(range(12))
    assert list(seen) == [10, 11]


def test_the_draws_a_pass_takes_are_put_back():
    own = torch.Generator().manual_seed(3)
    loader = _loader(sampler=RandomSampler(range(12), generator=own), generator=torch.Generator().manual_seed(4))
    drawn = worker_start._random_state(loader)
    first = ([int(i) for b in loader for i in b[0]], torch.rand(2).tolist())
    worker_start._restore(drawn)
    assert ([int(i) for b in loader for i in b[0]], torch.rand(2).tolist()) == first
