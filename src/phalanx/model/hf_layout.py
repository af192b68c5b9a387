"""A transformers checkpoint's own key layout, read into the model's (for `px.load_model`).

transformers 5 fuses a mixture-of-experts layer's experts into 3-D parameters (Qwen3-MoE's
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]), while its files keep
one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`):
`save_pretrained` writes them so, and `from_pretrained` converts them on load through the model's
conversion mapping (`transformers.conversion_mapping`: renamings, and converters that stack the
experts and concatenate gate and up). Here the same mapping, transformers' own code, maps a
checkpoint's keys onto the model's, and the same operations build each fused tensor, so `px.load_model`
reads what `from_pretrained` reads. A DTensor target (the experts under `ep`, split on dim 0) reads
only its own experts' tensors; any other split builds the fused tensor whole (one at a time) and keeps
its part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

Read = Callable[[str], torch.Tensor]  # checkpoint key -> its tensor (whole)


@dataclass
class Fused:
    """One model tensor built from several checkpoint tensors by a transformers WeightConverter."""

    converter: Any
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> checkpoint keys, in order

    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]

    def _build(self, tensors: dict[str, list[torch.Tensor]], model: nn.Module, target: str) -> torch.Tensor:
        out: Any = tensors
        for op in self.converter.operations:
            out = op.convert(
                out,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
                full_layer_name=target,
                model=model,
                config=getattr(model, "config", None),
                missing_keys=None,
            )
        (tensor,) = out.values()
        return tensor

    def shape(self, shapes: Mapping[str, tuple[int, ...]], model: nn.Module, target: str) -> tuple[int, ...]:
        """The fused tensor's shape, from the sources' shapes (the operations run on the meta device)."""
        meta = {p: [torch.empty(shapes[k], device="meta") for k in keys] for p, keys in self.sources.items()}
        return tuple(self._build(meta, model, target).shape)

    def experts_rows(self) -> bool:
        """Dim 0 of the fused tensor is the experts' list itself (stacked on dim 0, no later op on
        dim 0): a block of rows needs only those experts' tensors."""
        ops = self.converter.operations
        first = type(ops[0]).__name__ == "MergeModulelist" and getattr(ops[0], "dim", None) == 0
        rest = all(type(op).__name__ == "Concatenate" and getattr(op, "dim", 0) != 0 for op in ops[1:])
        return first and rest

    def read(self, read: Read, model: nn.Module, target: str, rows: slice | None = None) -> torch.Tensor:
        """The fused tensor (`rows`: only those experts, when `experts_rows`)."""
        chosen = {p: keys[rows] if rows is not None else keys for p, keys in self.sources.items()}
        return self._build({p: [read(k) for k in keys] for p, keys in chosen.items()}, model, target)


@dataclass
class Matched:
    """How a checkpoint's keys map onto the model's: renamed ones, fused ones, and what they consume."""

    renamed: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint key
    fused: dict[str, Fused] = field(default_factory=dict)  # model name -> its sources

    def consumed(self) -> set[str]:
        return set(self.renamed.values()) | {k for f in self.fused.values() for k in f.keys()}


def _transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model under `model` (a peft model's base model), or None."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers not installed: no transformers model, nothing to convert
        return None
    return base if isinstance(base, PreTrainedModel) else None


def match(model: nn.Module, found: Iterable[str], expected: Iterable[str]) -> Matched:
    """Map the checkpoint keys `found` onto the model names `expected` that `found` lacks, through the
    model's transformers conversion mapping (nothing for a model transformers has none for)."""
    found, expected = set(found), set(expected)
    matched = Matched()
    base = _transformers_model(model) if expected - found else None
    if base is None:  # every name there as it is, or no transformers model to ask
        return matched
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(base)
    renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    wanted = {name: 1 for name in expected}
    for key in sorted(found - expected, key=dot_natural_key):  # experts in their numeric order
        name, pattern = rename_source_key(key, renamings, converters, base.base_model_prefix, wanted)
        if name not in expected or name in found:
            continue
        if pattern is None:
            matched.renamed[name] = key
        else:
            fused = matched.fused.setdefault(name, Fused(by_pattern[pattern]))
            fused.sources.setdefault(pattern, []).append(key)
    return matched


def shapes(matched: Matched, found: Mapping[str, tuple[int, ...]], model: nn.Module) -> dict[str, tuple[int, ...]]:
    """`found` (checkpoint key -> shape) as the model's names see it: the matched keys under their
    model names, the fused ones' shapes as their operations make them."""
    out = {k: v for k, v in found.items() if k not in matched.consumed()}
    out.update({name: found[key] for name, key in matched.renamed.items()})
    out.update({name: fused.shape(found, model, name) for name, fused in matched.fused.items()})
    return out


def part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` as `target` holds it: this rank's part of a DTensor (any placements), a plain tensor whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        return full.to(device=target.device, dtype=target.dtype)
    full = full.to(device=target.to_local().device, dtype=target.dtype)
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)


def read_part(fused: Fused, read: Read, model: nn.Module, name: str, target: Any) -> tuple[torch.Tensor, int]:
    """(`target`'s part of the fused tensor `name`, the bytes read): a DTensor split on dim 0 (the
    experts under ep) reads its own experts' tensors only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from phalanx.model.meta_init import local_index

    by_rows = isinstance(target, DTensor) and fused.experts_rows()
    if by_rows and all(p == Shard(0) or isinstance(p, Replicate) for p in target.placements):
        local = fused.read(read, model, name, local_index(target)[0])
        size = local.numel() * local.element_size()
        local = local.to(device=target.to_local().device, dtype=target.dtype)
        placed = DTensor.from_local(
            local, target.device_mesh, target.placements, shape=target.shape, stride=target.stride(), run_check=False
        )
        return placed, size
    full = fused.read(read, model, name)
    return part(full, target), full.numel() * full.element_size()


def convert(state: Mapping[str, torch.Tensor], expected: Iterable[str], model: nn.Module) -> dict[str, torch.Tensor]:
    """A whole state dict in the checkpoint's layout, in the model's (what rank 0 broadcasts)."""
    matched = match(model, state, expected)
    if not matched.renamed and not matched.fused:
        return dict(state)
    out = {k: v for k, v in state.items() if k not in matched.consumed()}
    out.update({name: state[key] for name, key in matched.renamed.items()})
    out.update({name: fused.read(state.__getitem__, model, name) for name, fused in matched.fused.items()})
    return out
