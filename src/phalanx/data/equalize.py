"""Agreements that keep every rank's step count equal when the data alone cannot.

Two collectives, both tiny and both called by every rank at the same point of its loop:
- `agree_num_batches`: once per pass, when each rank knows its own batch count (pre-sharded data);
- `agree_step`: once per step, when nobody knows how many batches are left (IterableDataset, user
  iterables): "do I have a batch?" from every rank decides whether all continue, pad, or stop.
They are what lets any strategy (ddp, zero1..zero3, fsdp) survive uneven data: no rank ever enters
a collective that its peers will not enter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.runtime.collectives import world_size


def gather_ints(value: int) -> list[int]:
    """Every rank's `value`, in rank order (a world of one returns `[value]`)."""
    world = world_size()
    if world == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64)
    parts = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [int(p.item()) for p in parts]


def agree_num_batches(num_batches: int, drop: bool) -> int:
    """The number of batches every rank will yield this pass: the longest rank's (pad) or shortest's (drop).

    Padding needs something to repeat: a rank with no batch at all while others have some cannot pad.
    """
    counts = gather_ints(num_batches)
    if drop:
        return min(counts)
    target = max(counts)
    empty = [rank for rank, n in enumerate(counts) if n == 0]
    if target > 0 and empty:
        raise ValueError(
            f"phalanx: batches per rank are {counts}: rank(s) {empty} have no batch at all, so they "
            f"cannot repeat batches to match the {target} of the others. HINT: give every rank data, "
            "or build the DataLoader with drop_last=True to stop every rank at the shortest one."
        )
    return target


@dataclass(frozen=True)
class StepDecision:
    """What every rank does at this step: all take a real or padding batch, or all stop."""

    proceed: bool
    num_with_data: int  # ranks that hold a real batch this step
    donor: int | None = None  # a rank with data that lends a batch to ranks with nothing to repeat
    reals: tuple[int, ...] = ()  # every rank's real (not padding) samples this step, in rank order


def agree_step(has_data: bool, can_pad: bool, drop: bool, real: int = 0) -> StepDecision:
    """One small all-gather per step: go on while anyone has data (pad) or while everyone does (drop).

    A rank that ran out pads by repeating a batch it already yielded; a rank that never had one
    borrows one from `donor` (see `lend_batch`), so no data is ever skipped in pad mode. `real`: this
    rank's real samples in its batch, gathered so the step can be weighted by them (data/step_items.py).
    """
    world = world_size()
    if world == 1:
        return StepDecision(has_data, int(has_data), reals=(real,))
    mine = torch.tensor([int(has_data), int(can_pad), real], dtype=torch.int64)
    parts = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    have = [bool(p[0]) for p in parts]
    num_with_data = sum(have)
    if num_with_data == 0 or (drop and num_with_data < world):
        return StepDecision(False, num_with_data)
    needy = any(not p[0] and not p[1] for p in parts)
    return StepDecision(
        True, num_with_data, donor=have.index(True) if needy else None, reals=tuple(int(p[2]) for p in parts)
    )


def lend_batch(batch: Any, donor: int) -> Any:
    """Every rank gets rank `donor`'s batch (as a picklable object): the padding of ranks with none."""
    box = [batch if dist.get_rank() == donor else None]
    dist.broadcast_object_list(box, src=donor)
    return box[0]
