"""Gradient clipping by the global norm over every stage of a pipeline.

Each rank computes the norm of its own stages' gradients with `grad_norm.total_norm` (FSDP2's and
tensor parallel's DTensor gradients reduced over their meshes; DDP's already reduced and equal on
the replicas), then the pipeline ranks combine theirs: the p-th powers summed (the largest, for the
infinity norm). Every rank then scales its gradients by the same factor, as one process clipping
the whole model would.

torch's own `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` gives and applies that
norm too (as it does under tensor parallel, where DTensor's norm reduces the shards'): a stage's
parameters are plain tensors, disjoint from the other stages', so nothing in them can combine the
norms. `route_torch_clip` makes torch's norm function (`clip_grad.py`'s `_get_total_norm`, looked up
by `clip_grad_norm_` at each call, however the script imported it) combine the norms over the pipeline
when the gradients it is given are a pipeline-prepared model's; other gradients get torch's own norm.
Every rank of the pipeline must clip (each stage its own parameters), as one loop does.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from phalanx.strategies.optimizers.grad_norm import total_norm


def pipeline_norm(local: torch.Tensor, norm_type: float, pp_group: Any) -> torch.Tensor:
    """The norm over all stages from each pipeline rank's `local` norm (a collective over pp_group)."""
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    norm = local.detach().float().clone()
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm**norm_type
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
    return norm ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: Any = None,
    uncounted: set[int] | None = None,
) -> torch.Tensor:
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


NormFn = Callable[[list[torch.Tensor], float], torch.Tensor]
# (prepared model, the bound method giving the norm of its gradients over the pipeline), both weak:
# a finished Phalanx() and its model are not kept alive by torch's patched function
_routes: list[tuple[weakref.ref, weakref.WeakMethod]] = []
_torch_norm: Callable[..., torch.Tensor] | None = None  # torch's own, once replaced


def route_torch_clip(model: torch.nn.Module, norm: NormFn) -> None:
    """Make torch's clip_grad_norm_ use `norm(grads, norm_type)` (a bound method) for gradients of
    `model`'s parameters (this rank's stages): the global norm over the pipeline; once per prepared model."""
    global _torch_norm
    from torch.nn.utils import clip_grad

    if _torch_norm is None:
        _torch_norm = clip_grad._get_total_norm
        clip_grad._get_total_norm = _total_norm
    _routes[:] = [(ref, fn) for ref, fn in _routes if ref() is not None and fn() is not None]
    _routes.append((weakref.ref(model), weakref.WeakMethod(norm)))  # type: ignore[arg-type]


def _total_norm(
    tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> torch.Tensor:
    """torch's `_get_total_norm`, over the pipeline for a pipeline-prepared model's gradients."""
    assert _torch_norm is not None  # noqa: S101 - installed with the first route
    grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    given = {id(g) for g in grads}
    for ref, method in _routes:
        model, norm_fn = ref(), method()
        if (
            model is not None
            and norm_fn is not None
            and any(id(p.grad) in given for p in model.parameters() if p.grad is not None)
        ):
            norm = norm_fn(grads, float(norm_type))
            if error_if_nonfinite and not bool(torch.isfinite(norm)):
                raise RuntimeError(
                    f"The total norm of order {norm_type} for gradients from `parameters` is "
                    f"non-finite ({float(norm)}) over the pipeline's stages, so it cannot be clipped. "
                    "HINT: set error_if_nonfinite=False to scale the gradients by it anyway"
                )
            return norm
    return _torch_norm(grads, norm_type, error_if_nonfinite, foreach)
