"""Debug mode: before each phalanx collective, check that every rank calls the same one with
matching tensors, and say which rank differs, instead of hanging or aborting inside gloo/NCCL.

Costs one small all_gather_object per collective, so it is opt-in: `Phalanx(debug=True)`
(or --debug / PHALANX_DEBUG=1). (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL does this for its own collectives but
crashes when DDP is constructed under it on these machines.)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from phalanx.runtime.nested import map_tensors


def describe(data: Any) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every tensor in a nested batch, in traversal order."""
    found: list[tuple[tuple[int, ...], str]] = []
    map_tensors(lambda t: found.append((tuple(t.shape), str(t.dtype).replace("torch.", ""))), data)
    return found


def _compatible(a: list, b: list, ragged_dim0: bool) -> bool:
    if len(a) != len(b):
        return False
    for (shape_a, dtype_a), (shape_b, dtype_b) in zip(a, b):
        if dtype_a != dtype_b:
            return False
        if ragged_dim0 and len(shape_a) == len(shape_b) and shape_a[1:] == shape_b[1:]:
            continue
        if shape_a != shape_b:
            return False
    return True


def check_collective(op: str, data: Any, ragged_dim0: bool = False) -> None:
    """Raise on every rank if the ranks are not all about to run `op` on matching tensors.

    `ragged_dim0`: the collective accepts different lengths along dim 0 (gather).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = (op, describe(data))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ops = {o for o, _ in everyone}
    reference = everyone[0][1]
    if len(ops) == 1 and all(_compatible(reference, t, ragged_dim0) for _, t in everyone):
        return
    lines = []
    for rank, (o, tensors) in enumerate(everyone):
        shown = ", ".join(f"shape {tuple(s)} {d}" for s, d in tensors) or "no tensors"
        lines.append(f"  rank {rank}: {o}({shown})")
    what = "different collectives" if len(ops) > 1 else f"{op} with mismatched tensors"
    rule = (
        ""
        if len(ops) > 1
        else " (dims after the first must match)"
        if ragged_dim0
        else " (shapes and dtypes must match)"
    )
    raise RuntimeError(
        f"phalanx debug: the ranks called {what}{rule}:\n"
        + "\n".join(lines)
        + "\nHINT: every rank must call the same collectives in the same order with tensors of the same "
        "shape and dtype; look for rank-dependent branches or batch sizes before this call."
    )
