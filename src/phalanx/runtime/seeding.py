"""Seeding: the same global RNG streams on every rank, a distinct stream per DataLoader worker.

Global RNGs (Python's `random`, NumPy's legacy global generator, torch on every device) get the
same seed on every rank, so a model built after seeding starts identical everywhere. DataLoader
workers must NOT share streams across ranks (random crops and masks would repeat on every rank):
each prepared loader draws its workers' base seed from `worker_base_seed(seed, rank, epoch)`, and
torch's own worker loop then seeds `random`, NumPy and torch in worker `w` from that base and `w`.
A user's `worker_init_fn` still runs after that, as with any DataLoader. A prepared map-style loader
with workers also seeds each sample from (seed, epoch, index) (`seed_sample`), so what a sample
draws does not depend on the worker that loads it, and a mid-epoch resume is exact.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Iterator

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_INT63 = (1 << 63) - 1
_SAMPLE = 0x5A3D1E  # keeps per-sample seeds apart from worker base seeds of the same numbers


def seed_everything(seed: int, workers: bool = True) -> int:
    """Seed Python's `random`, NumPy and torch (CPU and every GPU) with `seed`; return it.

    Call it with the same seed on every rank: the ranks then build identical models. It records
    nothing: the data order and the workers' seeds follow the `seed` setting, so pass the seed on,
    `Phalanx(seed=seed_everything(42))` (or just `Phalanx(seed=42)`, which seeds the same RNGs).
    `workers` is kept for old scripts: workers' seeds are the `worker_seeds` setting now, and
    `workers=False` only says so (a warning) instead of changing loaders behind the script's back.
    """
    seed = check_seed(seed)
    if not workers:
        warnings.warn(
            "phalanx: seed_everything(..., workers=False) no longer changes how prepared loaders seed "
            "their workers. HINT: Phalanx(worker_seeds='shared') (PHALANX_WORKER_SEEDS=shared) gives "
            "every rank's workers the same seeds",
            FutureWarning,
            stacklevel=2,
        )
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator too
    return seed


def check_seed(seed: object) -> int:
    """`seed` as an int, or a ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}. HINT: seed_everything(42)")
    return int(seed)


def worker_base_seed(seed: int, rank: int, epoch: int) -> int:
    """A base seed for the DataLoader workers of `rank` in `epoch`: distinct per (seed, rank, epoch).

    torch gives worker `w` the seed `base + w` (and NumPy a SeedSequence of (base, w)), so workers of
    one rank differ by their id, and ranks differ by the base; 63 bits make overlaps negligible.
    """
    return _seed63(seed, rank, epoch)


def _seed63(seed: int, *words: int) -> int:
    """A 63-bit seed drawn from (seed, *words) by NumPy's SeedSequence: distinct inputs, unrelated seeds."""
    state = np.random.SeedSequence([seed & _MASK64, *words]).generate_state(2, dtype=np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & _INT63


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed `random`, NumPy and torch's CPU generator for loading sample `index` in `epoch`.

    Called in DataLoader workers before each sample (see data/sample_seeds.py); distinct per
    (seed, epoch, index) and independent of the rank and the worker, so the same sample gets the same
    draws on any number of ranks or workers. About 15 microseconds.
    """
    seed_cpu_rngs(_seed63(seed, epoch, index, _SAMPLE))  # CPU only: a worker process has no device streams


def shared_seed(seed: int, epoch: int, purpose: int) -> int:
    """A seed every rank and worker derives alike for `epoch` (a sampler's draw, a stream's shuffle):
    the same on any world size, distinct per (seed, epoch, purpose)."""
    return _seed63(seed, epoch, purpose)


@contextlib.contextmanager
def seeded_rngs(value: int) -> Iterator[None]:
    """Run the block with `random`, NumPy and torch's CPU generator seeded with `value`, and give the
    surrounding code its streams back afterwards (the model's randomness is not disturbed)."""
    saved = cpu_rng_states()
    seed_cpu_rngs(value)
    try:
        yield
    finally:
        set_cpu_rng_states(saved)


def seed_cpu_rngs(value: int) -> None:
    """Seed `random`, NumPy's global generator and torch's CPU generator with `value`."""
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.default_generator.manual_seed(value)


def cpu_rng_states() -> tuple:
    """The states of `random`, NumPy's global generator and torch's CPU generator."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_cpu_rng_states(states: tuple) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def seed_worker_generator(generator: torch.Generator, seed: int, rank: int, epoch: int) -> None:
    """Re-seed a loader's generator so that the next `iter(loader)` draws this rank's worker base seed."""
    generator.manual_seed(worker_base_seed(seed, rank, epoch))
