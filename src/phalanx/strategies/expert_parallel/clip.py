"""torch's `clip_grad_norm_` over gradients of several kinds: under ep x zero2/zero3 the experts'
gradients are plain tensors (each rank's own experts) beside FSDP2's DTensor ones, and torch's scaling
step (`clip_grad._clip_grads_with_norm_`, one foreach multiply per device and dtype) fails on such a
mix ("got mixed torch.Tensor and DTensor"). Its norm is routed to the experts' (pipeline/grads.py's
`route_torch_clip`); this makes its scaling take each kind apart, with the same norm. Gradients of one
kind go to torch's own function unchanged."""

from __future__ import annotations

from typing import Any, Callable

import torch

_torch_scale: Callable[..., Any] | None = None  # torch's own, once replaced


def scale_each_kind() -> None:
    """Install the scaling that takes plain and DTensor gradients (of each mesh) apart; once per process."""
    global _torch_scale
    from torch.nn.utils import clip_grad

    if _torch_scale is None:
        _torch_scale = clip_grad._clip_grads_with_norm_
        clip_grad._clip_grads_with_norm_ = _scale


def _scale(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    assert _torch_scale is not None  # noqa: S101 - installed before use
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    kinds: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            kinds.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(kinds) <= 1:
        return _torch_scale(params, max_norm, total_norm, foreach)
    for members in kinds.values():
        _torch_scale(members, max_norm, total_norm, foreach)
    return None
