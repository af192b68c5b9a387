"""Gradient clipping by the global norm over every stage of a pipeline.

Each rank computes the norm of its own stages' gradients with `grad_norm.total_norm` (FSDP2's and
tensor parallel's DTensor gradients reduced over their meshes; DDP's already reduced and equal on
the replicas), then the pipeline ranks combine theirs: the p-th powers summed (the largest, for the
infinity norm). Every rank then scales its gradients by the same factor, as one process clipping
the whole model would.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from phalanx.strategies.grad_norm import total_norm


def pipeline_norm(local: torch.Tensor, norm_type: float, pp_group: Any) -> torch.Tensor:
    """The norm over all stages from each pipeline rank's `local` norm (a collective over pp_group)."""
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    norm = local.detach().float().clone()
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm ** norm_type
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
    return norm ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    pp_group: Any = None, uncounted: set[int] | None = None) -> torch.Tensor:
    """Clip the gradients of `parameters` (this rank's stages) to the global norm `max_norm`;
    returns that norm before clipping, a plain tensor, the same on every rank. `uncounted`: ids of
    parameters clipped here but counted in the norm by another pipeline rank (tied copies)."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in params if id(p) not in (uncounted or ())], float(norm_type))
    if pp_group is not None:
        norm = pipeline_norm(norm, float(norm_type), pp_group)
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:  # DTensor gradients of different meshes do not mix in one foreach multiply
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for members in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(members, max_norm, norm.to(members[0].grad.device))
    return norm
