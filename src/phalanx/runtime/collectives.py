"""Collectives over nested batches (tensors inside tuples, lists, dicts) on torch.distributed.

Every function is a no-op identity in a world of one, so scripts run unchanged without a group.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.runtime.debug import check_collective
from phalanx.runtime.nested import map_tensors

REDUCTIONS = ("mean", "sum", "max", "min")
# all_gather_into_tensor's and reduce_scatter_tensor's new names (torch >= 2.13 warns on the old
# ones; older torch lacks the new).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor of a batch to `device`; objects with their own `.to` (BatchEncoding) too."""
    if not isinstance(data, (torch.Tensor, list, tuple, dict)) and callable(getattr(data, "to", None)):
        return data.to(device)
    return map_tensors(lambda t: t.to(device, non_blocking=True), data)


def is_distributed() -> bool:
    """Several ranks in the default group (a world of one has a group of its one rank: process_group.py)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size(group: Any = None) -> int:
    """Ranks in `group` (default: the default group); 1 with no group (a plain `python train.py`)."""
    return dist.get_world_size(group) if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _check(op: str, data: Any, ragged_dim0: bool = False) -> None:
    """Debug mode: every rank must be about to run the same collective on matching tensors."""
    check_collective(op, data, ragged_dim0)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def as_tensors(data: Any, device: torch.device | str, verb: str) -> tuple[Any, Callable[[Any], Any]]:
    """Python numbers in `data` as float64 tensors (a list or tuple of numbers as one 1-D tensor),
    and the function that turns the collective's result back into Python values. Any other
    non-tensor leaf is refused: passed through, it would be this rank's value, not a `verb`d one."""
    if isinstance(data, torch.Tensor):
        return data, lambda out: out
    if _is_number(data):
        return torch.tensor(float(data), dtype=torch.float64, device=device), (
            lambda out: out.item()
        ) if verb == "reduce" else (lambda out: out.tolist())
    if isinstance(data, (list, tuple)) and data and all(_is_number(x) for x in data) and not hasattr(data, "_fields"):
        kind = type(data)
        return torch.tensor([float(x) for x in data], dtype=torch.float64, device=device), lambda out: kind(
            out.tolist()
        )
    if isinstance(data, (list, tuple)):
        pairs = [as_tensors(x, device, verb) for x in data]
        make = (lambda xs: type(data)(*xs)) if hasattr(data, "_fields") else type(data)
        return make([t for t, _ in pairs]), lambda out: make([back(o) for (_, back), o in zip(pairs, out)])
    if isinstance(data, dict):
        parts = {k: as_tensors(v, device, verb) for k, v in data.items()}
        return type(data)({k: t for k, (t, _) in parts.items()}), lambda out: type(data)(
            {k: back(out[k]) for k, (_, back) in parts.items()}
        )
    raise TypeError(
        f"px.{verb} takes tensors and Python numbers (also in lists, tuples and dicts); got a "
        f"{type(data).__name__} ({data!r:.40}). HINT: for other objects use "
        f"{'px.gather_for_metrics on a list' if verb == 'gather' else 'a tensor or a number'}"
    )


def reduce(
    data: Any, reduction: str = "mean", debug: bool = False, group: Any = None, device: torch.device | str = "cpu"
) -> Any:
    """All-reduce every tensor over `group` (default: every rank); every rank receives the result.
    Python numbers (alone, or in lists, tuples, dicts) are reduced too and come back as Python
    floats. Input tensors are not modified."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    data, back = as_tensors(data, device, "reduce")
    world = world_size(group)
    if debug and world > 1:
        _check(f"reduce[{reduction}]", data)

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if world == 1:
            return out
        if reduction == "mean" and not out.is_floating_point():
            raise ValueError(f"reduce(..., 'mean') needs a floating-point tensor, got {out.dtype}")
        op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
            reduction
        ]
        dist.all_reduce(out, op=op, group=group)
        if reduction == "mean":
            out /= world
        return out

    return back(map_tensors(one, data))


def gather(data: Any, debug: bool = False, group: Any = None, device: torch.device | str = "cpu") -> Any:
    """Concatenate every tensor along dim 0 over the ranks of `group` (default: all), in rank order.

    Ranks may hold different lengths along dim 0 (the last batch, a filtered batch); the other
    dims must match. 0-d tensors become one row per rank. A Python number becomes a list of one
    per rank, a list of numbers the ranks' lists concatenated.
    """
    data, back = as_tensors(data, device, "gather")
    return back(_gather(data, debug, group))


def _gather(data: Any, debug: bool, group: Any) -> Any:
    if debug and world_size() > 1:
        _check("gather", map_tensors(lambda t: t.reshape(1) if t.dim() == 0 else t, data), ragged_dim0=True)
    if world_size(group) == 1:
        return map_tensors(lambda t: t.detach().clone() if t.dim() else t.detach().reshape(1), data)
    return map_tensors(lambda t: _gather_one(t, group), data)


def _gather_one(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    t = t.contiguous()
    world = world_size(group)
    length = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    longest = max(sizes)
    if t.shape[0] < longest:
        pad = t.new_zeros((longest - t.shape[0], *t.shape[1:]))
        t = torch.cat([t, pad])
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def gather_object(obj: Any, debug: bool = False, group: Any = None) -> list[Any]:
    """Gather one picklable object per rank of `group` into a list on every rank."""
    world = world_size(group)
    if world == 1 and not is_distributed():
        return [obj]
    if debug:
        _check("gather_object", None)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(data: Any, src: int = 0, debug: bool = False) -> Any:
    """Copy tensors from rank `src` to every rank (in place on the receivers, also returned)."""
    if world_size() == 1:
        return data
    if debug:
        _check(f"broadcast[src={src}]", data)

    def one(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=src)
        return t

    return map_tensors(one, data)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank `src`'s picklable object, returned on every rank of `group`."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(debug: bool = False, group: Any = None) -> None:
    """Wait until every rank of `group` is here (no-op in a world of one)."""
    if not is_distributed():
        return
    if debug:
        _check("barrier", None)
    dist.barrier(group=group)
