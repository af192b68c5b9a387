"""Rank functions for test_worker_start.py: a DataLoader worker that never starts after its fork.

`arm(n)` makes the n-th fork from now (counted in this rank) a child that sleeps before it runs
any of the worker's code: what CPython's fork deadlock (gh-112275) leaves, on demand. The child
adds its pid to a file first, so the test can tell the workers phalanx replaced from any others.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler

from phalanx import Phalanx
from phalanx.data import worker_start
from tests.data_counts import ids

N = 48
EPOCHS = 2
_countdown = [0]  # forks left before the one that hangs (0: none armed)
_this_one_hangs = [False]  # read by the child, as the parent set it just before the fork
_hung_file = [""]


def _before_fork() -> None:
    _this_one_hangs[0] = _countdown[0] == 1
    _countdown[0] = max(0, _countdown[0] - 1)


def _in_child() -> None:
    if _this_one_hangs[0]:
        with open(_hung_file[0], "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(60)  # longer than the guard waits; killed by it


def arm(n: int) -> None:
    _countdown[0] = n


def loaders() -> dict[str, DataLoader]:
    """A sampler drawing from torch's global generator (kept by phalanx), and one with its own."""
    data = TensorDataset(torch.arange(N))
    weighted = WeightedRandomSampler(torch.linspace(0.1, 1.0, N), N)
    own = RandomSampler(data, generator=torch.Generator().manual_seed(11))
    return {
        "global_rng": DataLoader(data, batch_size=4, sampler=weighted, num_workers=2),
        "own_generator": DataLoader(data, batch_size=4, sampler=own, num_workers=2),
    }


def _read(px: Phalanx, hang: dict[str, tuple[int, int]]) -> dict:
    """Each loader's items per epoch; `hang[name] = (epoch, n)` arms the n-th fork of that epoch's pass."""
    out = {}
    torch.manual_seed(5)
    for name, loader in loaders().items():
        prepared = px.prepare(loader)
        epochs = []
        for epoch in range(EPOCHS):
            if hang.get(name, (None, 0))[0] == epoch:
                arm(hang[name][1])
            epochs.append([i for batch in prepared for i in ids(batch)])
        out[name] = epochs
    return out


def stuck_fork(hang_on_rank1: dict[str, list[int]], timeout: float, folder: str) -> dict:
    worker_start.FORK_CAN_HANG = True  # the guard runs on every Python here, fixed ones included
    worker_start.START_TIMEOUT_S = timeout
    _hung_file[0] = os.path.join(folder, f"hung-{os.environ['RANK']}")
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    px = Phalanx(strategy="ddp", seed=7)
    reference = _read(px, {})
    hang = {name: tuple(v) for name, v in hang_on_rank1.items()} if px.rank == 1 else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        guarded = _read(px, hang)
        seconds = time.monotonic() - started
    replaced = [str(w.message) for w in caught if "did not start" in str(w.message)]
    hung = open(_hung_file[0]).read().split() if os.path.exists(_hung_file[0]) else []
    return {
        "reference": reference,
        "guarded": guarded,
        "replaced": replaced,
        "hung": [int(p) for p in hung],
        "seconds": seconds,
    }
