"""Gradient clipping by the global norm over every stage of a pipeline.

Each rank computes the norm of its own stages' gradients (over the data-parallel group too when
they are FSDP2 shards: DTensor's norm is already the full one; DDP's are already reduced and equal
on the replicas), then the pipeline ranks combine theirs: the p-th powers summed (the largest, for
the infinity norm). Every rank then scales its gradients by the same factor, as one process
clipping the whole model would.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    pp_group: Any = None, foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of `parameters` (this rank's stages) to the global norm `max_norm`;
    returns that norm, a plain tensor, the same on every rank."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    if hasattr(norm, "full_tensor"):  # FSDP2 gradients: a DTensor norm, reduced over the shards
        norm = norm.full_tensor()
    if pp_group is not None:
        group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
        norm = norm.float()
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm ** norm_type
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
            norm = norm ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
    return norm
