"""Samplers phalanx does not rebuild, dealt to the data-parallel ranks without changing what they draw.

RandomSampler with `replacement`, `num_samples` or its own `generator`, WeightedRandomSampler,
SubsetRandomSampler and any custom sampler keep their own draw: each epoch every rank lets the user's
sampler draw the epoch's whole index sequence, identically, and takes every N-th index, as
DistributedSampler does with its permutation (`UserSampler`). A step's samples over all ranks are then
a contiguous run of the one-process draw, so the global batch equals one process's, and a position
saved as a global sample count resumes on any world size.

The draw is the same on every rank and reproducible (`EpochDraw`): a sampler with its own
`torch.Generator` uses it (the script seeds it alike on every rank, as it would for one process),
and its state at the start of the epoch is what a checkpoint keeps, so a resume reproduces the
epoch's draw instead of drawing a new one; a sampler that draws from torch's global RNG draws under
a seed phalanx derives from (seed, epoch), and the model's global streams are left as they were.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Sampler

from phalanx.data.sample_seeds import tag
from phalanx.runtime.seeding import seeded_rngs, shared_seed

_DRAW = 0xD7A3  # keeps a sampler's per-epoch seed apart from other per-epoch seeds


def own_generator(sampler: Any) -> torch.Generator | None:
    """The sampler's own generator (or, for a batch sampler, its inner sampler's), if it has one."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        generator = getattr(candidate, "generator", None)
        if isinstance(generator, torch.Generator):
            return generator
    return None


class EpochDraw:
    """One epoch of a user's sampler (or batch sampler) as a list, the same on every rank and on resume."""

    def __init__(self, sampler: Any, seed: int):
        self.sampler = sampler
        self.seed = seed
        self._start: torch.Tensor | None = None  # the own generator's state when this epoch's draw began
        self._pending: torch.Tensor | None = None  # a saved state to draw the next epoch from (resume)

    def __call__(self, epoch: int) -> list[Any]:
        generator = own_generator(self.sampler)
        if generator is not None:
            if self._pending is not None:
                generator.set_state(self._pending)
                self._pending = None
            self._start = generator.get_state()
        with seeded_rngs(shared_seed(self.seed, epoch, _DRAW)):
            return list(self.sampler)

    def state(self, mid_epoch: bool) -> torch.Tensor | None:
        """What a checkpoint keeps: the generator as the epoch in progress began (mid-epoch: the draw
        is reproduced), or as it is now (between epochs: the next draw continues from it)."""
        generator = own_generator(self.sampler)
        if generator is None:
            return None
        if self._pending is not None:
            return self._pending.clone()
        return (self._start if mid_epoch and self._start is not None else generator.get_state()).clone()

    def fingerprint(self) -> int | None:
        """A number equal on two ranks when their samplers' own generators are in the same state."""
        generator = own_generator(self.sampler)
        if generator is None:
            return None
        return int.from_bytes(hashlib.sha256(generator.get_state().numpy().tobytes()).digest()[:7], "big")

    def restore(self, state: torch.Tensor | None) -> None:
        if state is not None and own_generator(self.sampler) is None:
            raise ValueError(
                "the checkpoint holds a sampler generator's state, and this loader's sampler has no "
                "generator. HINT: resume with the same sampler as the saved run"
            )
        self._pending = state


class UserSampler(Sampler[int]):
    """The user's sampler, drawn whole each epoch, every N-th index to each rank (see module doc).

    Without drop_last the draw is padded by repeating its first indices so every rank gets the same
    count; `num_real_samples` says how many of this rank's are not repeats (gather_for_metrics).
    """

    def __init__(
        self,
        sampler: Sampler,
        num_replicas: int,
        rank: int,
        *,
        seed: int,
        drop_last: bool = False,
        tag_epoch: bool = False,
    ):
        self.sampler = sampler
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last, self.tag_epoch = drop_last, tag_epoch
        self.epoch = 0
        self.draw = EpochDraw(sampler, seed)

    def __len__(self) -> int:
        total = len(self.sampler)  # type: ignore[arg-type]
        return total // self.num_replicas if self.drop_last else math.ceil(total / self.num_replicas)

    @property
    def num_real_samples(self) -> int:
        if self.drop_last:
            return len(self)
        return len(
            range(
                self.rank,
                min(len(self.sampler), len(self) * self.num_replicas),  # type: ignore[arg-type]
                self.num_replicas,
            )
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = [int(i) for i in self.draw(self.epoch)]
        needed = len(self) * self.num_replicas
        if needed > len(order) and order:
            order += (order * math.ceil(needed / len(order)))[: needed - len(order)]
        mine = order[self.rank : needed : self.num_replicas]
        return iter(tag(mine, self.epoch) if self.tag_epoch else mine)


def check_same_draw(draw: EpochDraw, gather_ints: Callable[[int], list[int]]) -> None:
    """Refuse a sampler whose own generator differs between ranks: their draws would not be one draw, so
    items would be repeated and lost silently."""
    mine = draw.fingerprint()
    if mine is None:
        return
    states = gather_ints(mine)
    if len(set(states)) > 1:
        raise ValueError(
            f"the DataLoader's sampler has its own generator, in a different state on each rank "
            f"({len(set(states))} different states over {len(states)} ranks): every rank must draw the same "
            "epoch for phalanx to deal it out, or items would repeat and go missing. HINT: seed it the same on "
            "every rank (torch.Generator().manual_seed(SEED), not from the rank), or leave generator=None and "
            "phalanx draws from a seed shared by all ranks"
        )
