"""Gradient clipping by the global norm in every layout: plain gradients (replicated, identical on
every rank after the all-reduce), FSDP2's sharded ones and tensor parallel's, which are DTensors,
possibly on different meshes (FSDP2 x TP: split layers on the 2-D mesh, norms on the data-parallel
one alone). Each mesh's gradients get one norm computation with its collectives; the parts are
combined here, so no rank's shard is counted twice or left out."""

from __future__ import annotations

import math
from typing import Any

import torch


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all `grads` together, as a plain tensor, the same on every rank."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    parts = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    stacked = torch.stack([p.to(device, torch.float32) for p in parts])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_(parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of `parameters` so their global norm is at most `max_norm`; return the
    norm before clipping (a plain tensor, as torch.nn.utils.clip_grad_norm_ does)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    if len(meshes) <= 1:  # one kind: torch's own clipping (its DTensor norm all-reduces the shards')
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = total_norm(grads, float(norm_type))
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
