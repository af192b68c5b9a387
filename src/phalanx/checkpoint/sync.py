"""The few collectives a save/load needs, on an explicit group (None = default), no-ops alone."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def barrier(group: Any = None) -> None:
    if is_dist():
        dist.barrier(group=group)


def all_gather(obj: T, group: Any = None) -> list[T]:
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: T, group: Any = None) -> T:
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def on_main(fn: Callable[[], T], group: Any = None) -> T:
    """Run `fn` on rank 0 and share its result; if it raises, every rank raises (no rank hangs)."""
    result, error = None, None
    if rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # re-raised below on rank 0, reported to the other ranks
            error = exc
    shared_error = broadcast(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if shared_error is not None:
        raise RuntimeError(f"rank 0 failed while handling the checkpoint: {shared_error}")
    return broadcast(result, group)
