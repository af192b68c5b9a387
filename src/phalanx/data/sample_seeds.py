"""Per-sample seeds in DataLoader workers: a sample's random augmentation depends on the sample, not
on which worker happened to load it.

A worker's RNG stream runs through every sample that worker loads. Resuming mid-epoch skips the
consumed batches without loading them, so the workers' streams restart and every later sample would
be augmented differently from the uninterrupted run. Seeding `random`, NumPy and torch before each
sample from (seed, epoch, sample index) makes the draws a function of the sample alone: exact on
resume, and the same whatever the number of workers or ranks. The epoch travels with the index
(`SampleKey`), so persistent workers, created once, still see each new epoch.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch.utils.data import Dataset, get_worker_info

from phalanx.runtime.seeding import seed_sample


class SampleKey(int):
    """A dataset index that carries the epoch it was drawn in; indexes like the plain int it is."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> "SampleKey":
        key = super().__new__(cls, index)
        key.epoch = epoch
        return key

    def __reduce__(self) -> tuple:
        return SampleKey, (int(self), self.epoch)


def tag(indices: Iterable[int], epoch: int) -> list[SampleKey]:
    return [SampleKey(i, epoch) for i in indices]


class SampleSeeded(Dataset):
    """The user's map-style dataset, with each sample loaded in a worker under its own seed.

    Attributes are read from and written to the user's dataset, so a `worker_init_fn` that
    configures `get_worker_info().dataset` configures the user's. In the main process (no workers)
    nothing is re-seeded: the global streams there belong to the model and are checkpointed.
    """

    _OWN = ("dataset", "seed")

    def __init__(self, dataset: Dataset, seed: int):
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "seed", seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int) -> Any:
        self._seed_for(key)
        return self.dataset[int(key)]

    def __getitems__(self, keys: list[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        if not getitems:
            return [self[k] for k in keys]
        self._seed_for(keys[0])  # one call loads the batch: its draws follow the batch's first sample
        return getitems([int(k) for k in keys])

    def _seed_for(self, key: int) -> None:
        if isinstance(key, SampleKey) and get_worker_info() is not None:
            seed_sample(self.seed, key.epoch, int(key))

    def __getattr__(self, name: str) -> Any:
        if name in SampleSeeded._OWN or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling) or a protocol probe
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SampleSeeded._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)
