"""Activation bytes per rank: what a forward keeps for its backward, with and without activation
checkpointing, found by running the forward (on the meta device: nothing is computed or allocated)
under autograd's saved-tensor hooks.

Without checkpointing a rank holds every tensor the forward saves. With checkpointing of each unit
(the blocks zero3 shards: strategies/fsdp.py's default units), it holds what is saved outside the
units, each unit's inputs, and during backward one unit's recomputed activations at a time. The
backward's peak adds a workspace of gradients (see ActivationBytes.backward_workspace). Checked
against the resident memory of a real CPU process in tests/unit/test_plan_activations.py.
Parameters saved for backward are model state, not activations, and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn


@dataclass
class ActivationBytes:
    outside: int = 0
    """saved by modules outside the units (embedding, head, loss)."""
    unit_inputs: list[int] = field(default_factory=list)
    """each unit's input tensors (what a checkpointed unit keeps)."""
    unit_saved: list[int] = field(default_factory=list)
    """saved inside each unit (what checkpointing recomputes instead)."""

    largest: int = 0
    """the largest single saved tensor."""

    @property
    def backward_workspace(self) -> int:
        """Gradients alive beside the saved tensors in backward: one of the largest activation
        and one flowing between blocks (measured against RSS: within 2% without checkpointing)."""
        return self.largest + max(self.unit_inputs, default=0)

    @property
    def peak(self) -> int:
        """Peak during backward without checkpointing."""
        return self.full + self.backward_workspace

    @property
    def peak_checkpointed(self) -> int:
        """Peak during backward with each unit checkpointed."""
        return self.checkpointed + self.backward_workspace

    @property
    def full(self) -> int:
        """Held at the end of the forward without activation checkpointing."""
        return self.outside + sum(self.unit_saved)

    @property
    def checkpointed(self) -> int:
        """Peak with each unit checkpointed: kept inputs plus the largest unit recomputed."""
        return self.outside + sum(self.unit_inputs) + max(self.unit_saved, default=0)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.device.type != "meta" else t.numel() * t.element_size()


def _key(t: torch.Tensor) -> Any:
    # Views of one tensor (x and x.t()) share a storage: count it once. Meta tensors have no
    # data pointer, so there the base tensor stands for the storage.
    base = t._base if t._base is not None else t
    return id(base) if t.device.type == "meta" else t.untyped_storage().data_ptr()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def measure(model: nn.Module, inputs: Sequence[Any], units: Sequence[nn.Module]) -> ActivationBytes:
    """Run `model(*inputs)` (and a scalar loss) recording the bytes each part saves for backward."""
    out = ActivationBytes(unit_inputs=[0] * len(units), unit_saved=[0] * len(units))
    params = {_key(p) for p in model.parameters()}
    seen: set[Any] = set()
    current: list[int] = []  # the unit being run (innermost last)
    keep: list[torch.Tensor] = []  # saved tensors stay alive, so their keys stay unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in params and key not in seen:
            seen.add(key)
            keep.append(t)
            out.largest = max(out.largest, _nbytes(t))
            if current:
                out.unit_saved[current[-1]] += _nbytes(t)
            else:
                out.outside += _nbytes(t)
        return t

    handles = []
    for i, unit in enumerate(units):

        def enter(_module: nn.Module, args: tuple, i: int = i) -> None:
            if not current:
                out.unit_inputs[i] += sum(t.numel() * t.element_size() for t in _tensors(args))
            current.append(i)

        handles.append(unit.register_forward_pre_hook(enter))

        def leave(*_: Any) -> None:  # a forward hook's return value would replace the output
            current.pop()

        handles.append(unit.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return out


def parse_input(spec: str) -> tuple[tuple[int, ...], torch.dtype]:
    """'16x32' -> ((16, 32), int64 token ids); '16x3x224x224:float32' -> a float tensor."""
    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = tuple(int(n) for n in shape_text.lower().split("x"))
    except ValueError:
        shape = ()
    dtype = getattr(torch, dtype_text or "int64", None)
    if not shape or any(n < 1 for n in shape) or not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"cannot read --input {spec!r}; HINT: write the per-rank batch's shape and dtype, "
            "e.g. 16x32 (token ids, int64) or 16x3x224x224:float32"
        )
    return shape, dtype


def meta_input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")
