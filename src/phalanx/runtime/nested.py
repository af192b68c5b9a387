"""Nested batches (tensors inside tuples, lists, dicts, namedtuples): one walk over them, shared by the
collectives (collectives.py) and their debug checks (debug.py), so neither imports the other for it."""

from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply `fn` to every tensor in a nested structure, keeping the structure."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(fn, v) for v in data)
    if isinstance(data, dict):
        return type(data)({k: map_tensors(fn, v) for k, v in data.items()})
    return data
