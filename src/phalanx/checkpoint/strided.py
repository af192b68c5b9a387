"""Expert weights split gate-and-up apart (tp's `packed_colwise`), stored in a form DCP can write.

transformers' MoE tp style `packed_colwise` splits a fused `gate_up_proj` [E, 2I, H] so that rank r
holds gate rows r and up rows r (`_StridedShard(1, split_factor=2)`, strategies/tp_experts.py): two
blocks of the one-process tensor. DCP describes each rank's part as ONE block (offset, size), so it
refuses to save them ("overlapping chunks": rank 1's [8, 24) meets rank 0's [0, 16)) and would read
rows [8, 24) into rank 1 on load. Here such a tensor (a weight, or its optimizer moments) is handed
to DCP re-split on its first dimension (`Shard(0)`: each rank a contiguous block of experts) and put
back in its own placements after a load. The checkpoint holds the one-process tensor, as under any
other layout, so it moves between tp, ep, zero3 and one process. Each re-split gathers one tensor
whole for a moment (one at a time).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def _strided(value: Any) -> bool:
    """A DTensor with a `_StridedShard` that no later mesh dimension's shard of the same tensor dimension
    explains. FSDP2 over tp writes `_StridedShard(0)` on its own mesh dimension, the tp shard of dim 0
    following it: DCP places those parts right, and they are left as they are."""
    if not isinstance(value, DTensor):
        return False
    placements = value.placements
    return any(
        isinstance(p, _StridedShard)
        and not any(isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim for q in placements[i + 1 :])
        for i, p in enumerate(placements)
    )


def _resplit(value: DTensor, placements: Any) -> DTensor:
    """`value` over the same mesh in `placements` (every rank gathers it whole, then keeps its part)."""
    whole = value.full_tensor()
    return distribute_tensor(whole, value.device_mesh, placements, src_data_rank=None)


def to_saveable(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`state` with its strided DTensors re-split on dim 0, key -> the placements they had)."""
    out, placements = dict(state), {}
    for key, value in state.items():
        if _strided(value):
            placements[key] = value.placements
            out[key] = _resplit(value, [Shard(0)] * value.device_mesh.ndim)
    return out, placements


def from_saveable(state: Mapping[str, Any], placements: Mapping[str, Any]) -> dict[str, Any]:
    """`state` loaded into `to_saveable`'s tensors, each of `placements`' keys back in its placements."""
    out = dict(state)
    for key, kept in placements.items():
        if key in out:
            out[key] = _resplit(out[key], kept)
    return out
