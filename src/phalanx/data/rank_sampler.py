"""The script's own DistributedSampler, taken over rather than sharded a second time.

A torchrun-era script builds `DataLoader(ds, sampler=DistributedSampler(ds))` and calls
`sampler.set_epoch(epoch)`. Sharding that loader again would leave each rank 1/N of its 1/N; and
the script's sampler counts every process (`num_replicas = world_size`), where under tp / pp the
ranks of one model replica must read the same rows. So `prepare` recognises a sampler that
already shards by rank (a DistributedSampler, a subclass, or any sampler with integer
`num_replicas` and `rank`) and re-points a copy of it at the data-parallel ranks, keeping its
order, shuffle, seed and drop_last; `set_epoch` on the script's object still decides the epoch.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterator

from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from phalanx.data.sample_seeds import tag


def shards_by_rank(sampler: Any) -> bool:
    """A DistributedSampler (or subclass), or a sampler that says it splits over ranks."""
    if isinstance(sampler, DistributedSampler):
        return True
    return all(
        isinstance(getattr(sampler, name, None), int) and not isinstance(getattr(sampler, name), bool)
        for name in ("num_replicas", "rank")
    ) and hasattr(sampler, "__iter__")


def _repointed(sampler: Any, num_replicas: int, rank: int) -> Any:
    """A shallow copy of `sampler` splitting over `num_replicas` ranks as rank `rank`; its sizes are
    recomputed with DistributedSampler's arithmetic when it keeps them (num_samples, total_size)."""
    twin = copy.copy(sampler)
    twin.num_replicas, twin.rank = num_replicas, rank
    if all(hasattr(twin, name) for name in ("num_samples", "total_size", "dataset")):
        length = len(twin.dataset)
        if getattr(twin, "drop_last", False) and length % num_replicas:
            twin.num_samples = math.ceil((length - num_replicas) / num_replicas)
        else:
            twin.num_samples = math.ceil(length / num_replicas)
        twin.total_size = twin.num_samples * num_replicas
    return twin


class TakenOverSampler(Sampler[int]):
    """The script's rank-sharding sampler, re-pointed at the data-parallel ranks.

    `user` is the script's own object. The script chooses the epoch as it did with torch: by
    `set_epoch` on its own sampler object (its `.epoch` moves), or on the prepared loader's
    `.sampler` (seed 003 writes `trainloader.sampler.set_epoch(ep)`); the last choice holds for each
    new pass, as with torch. Until the script chooses, the prepared loader advances the epoch itself.
    `num_real_samples` counts this rank's samples that are not DistributedSampler's padding repeats
    (gather_for_metrics drops those). With `tag_epoch`, indices carry the epoch (per-sample seeds in
    workers).
    """

    def __init__(self, user: Any, num_replicas: int, rank: int, tag_epoch: bool = False):
        self.user = user
        self.inner = _repointed(user, num_replicas, rank)
        self.tag_epoch = tag_epoch
        self._user_epoch_seen = getattr(user, "epoch", None)
        self._chosen: int | None = None  # the epoch the script chose last; None: it never did
        self._next_call_is_the_loaders = False
        self.epoch = 0

    def epoch_for_pass(self, own: int) -> int:
        """The epoch the next pass uses: the script's last choice, else `own` (the loader's count).
        The loader's own set_epoch call for that pass follows."""
        current = getattr(self.user, "epoch", None)
        if current != self._user_epoch_seen:  # the script called set_epoch on its own object
            self._user_epoch_seen = current
            self._chosen = int(current)  # type: ignore[arg-type]
        self._next_call_is_the_loaders = True
        return own if self._chosen is None else self._chosen

    def set_epoch(self, epoch: int) -> None:
        if self._next_call_is_the_loaders:
            self._next_call_is_the_loaders = False
        else:  # the script's call, through the prepared loader's `.sampler`
            self._chosen = epoch
        self.epoch = epoch
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)
        elif hasattr(self.inner, "epoch"):
            self.inner.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.inner)
        return iter(tag(indices, self.epoch)) if self.tag_epoch else indices

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def num_real_samples(self) -> int | None:
        inner = self.inner
        if not all(hasattr(inner, name) for name in ("num_samples", "total_size", "dataset")):
            return None
        if getattr(inner, "drop_last", False):
            return inner.num_samples
        return len(range(inner.rank, min(len(inner.dataset), inner.total_size), inner.num_replicas))

    def describe(self, dp_size: int) -> str:
        """The log line: what the script built, and what it became."""
        user = self.user
        kind = type(user).__name__
        settings = ", ".join(
            f"{name}={getattr(user, name)!r}" for name in ("shuffle", "seed", "drop_last") if hasattr(user, name)
        )
        groups = (
            ""
            if dp_size == getattr(user, "num_replicas", dp_size)
            else f" (it counted {user.num_replicas} processes; ranks that hold one model replica read the same rows)"
        )
        return (
            f"prepare() took over the script's {kind}({settings}): it now splits the data over the "
            f"{dp_size} data-parallel rank{'s' if dp_size != 1 else ''}{groups} instead of being split a "
            f"second time; set_epoch on it still sets the epoch"
        )
