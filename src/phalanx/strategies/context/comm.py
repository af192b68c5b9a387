"""Autograd Functions over torch's collectives for attention across the cut: an all-gather along
the sequence whose backward reduce-scatters the gradients, and the all-to-all Ulysses swaps heads
for sequence with (its own transpose: the backward is the same exchange)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        world = dist.get_world_size(group)
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((world * front.shape[0], *front.shape[1:]))
        dist.all_gather_into_tensor(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        world = dist.get_world_size(ctx.group)
        front = grad.movedim(ctx.dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
        dist.reduce_scatter_tensor(out, front, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every cp rank's part of `x` concatenated along `dim`, in rank order; gradients reduce-scattered back."""
    return _GatherSequence.apply(x, dim, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, S/cp, D] held per sequence part -> [B, H/cp, S, D] held per head group (gathered order)."""
    world = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = x.reshape(b, world, h // world, s, d).permute(1, 0, 2, 3, 4)  # block i goes to rank i
    got = _AllToAll.apply(blocks, group)  # block i came from rank i: its part of the sequence
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of heads_to_sequence: [B, H/cp, S, D] -> [B, H, S/cp, D]."""
    world = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = x.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4)  # sequence part i goes to rank i
    got = _AllToAll.apply(blocks, group)  # block i: rank i's head group
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * h, s // world, d)
