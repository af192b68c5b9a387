"""Every rank makes a call that only works when every rank makes it (save_pretrained of a split
model gathers from all of them): the ranks first meet in the job's store, and a rank that waits alone
is refused with a message instead of hanging in the collective.

The calls are counted per process and only when every rank arrived, so the count stays the same on
every rank: a call refused on one rank (its key withdrawn) leaves the next call on every rank meeting
under one number.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch.distributed as dist

from phalanx import store_keys
from phalanx.runtime.process_group import store_client

_met: dict[str, int] = {}  # per kind of call: this process's calls that every rank made


def every_rank_called(what: str, wait_s: float, refusal: Callable[[int, list[int]], str]) -> None:
    """Return once every rank called `what`; ValueError(refusal(rank, absent ranks)) after `wait_s`
    seconds without them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wait = datetime.timedelta(seconds=wait_s)
    store = store_client(wait)  # a connection of its own: the job's store keeps its own timeout
    keys = [store_keys.arrival_key(what, _met.get(what, 0) + 1, r) for r in range(world)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, wait)
    except (RuntimeError, dist.DistError) as error:  # the store's timeout: some rank never came
        absent = [r for r, key in enumerate(keys) if not store.check([key])]
        store.delete_key(keys[rank])  # not counted: a later call on every rank meets under this number
        raise ValueError(refusal(rank, absent)) from error
    _met[what] = _met.get(what, 0) + 1
