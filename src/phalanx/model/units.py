"""The units a model is cut into (each transformer block, by default), and the per-unit transforms
every layout applies before wrapping or sharding the model, in torchtitan's order: activation
checkpointing inside, then compile, then (zero2/zero3) fully_shard."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Union

import torch
from torch import nn

from phalanx.model import activation_ckpt
from phalanx.model import compile as compile_units

# Which submodules zero2/zero3 shard as one unit: module classes, or a predicate on (name, module).
ShardSpec = Union[Iterable[type], Callable[[str, nn.Module], bool], None]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def default_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's top-level ModuleList/Sequential (each transformer layer) when it
    has one, else each top-level child with parameters; a lone child holding everything is looked
    into. Embeddings, head and norms next to the blocks stay in the root unit, which keeps its
    parameters gathered from forward to backward: measured in bench/strategies.py, this saves
    re-gathering a large embedding in backward (~16% less CPU per step than a unit of its own)."""
    children = [c for c in model.children() if _has_params(c)]
    if (
        len(children) == 1
        and not isinstance(children[0], _CONTAINERS)
        and len(list(children[0].children())) > 0
        and not any(True for _ in model.parameters(recurse=False))
    ):
        return default_units(children[0])
    containers = [c for c in children if isinstance(c, _CONTAINERS)]
    if containers:
        return [b for c in containers for b in c.children() if _has_params(b)]
    holding = [c for c in children if any(isinstance(m, _CONTAINERS) for m in c.modules())]
    if len(holding) == 1:  # a head around the stack (transformers' XForCausalLM: model + lm_head)
        return default_units(holding[0])
    return children


def without_split_ties(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """`units` less those holding a parameter that a module outside them holds too (tied
    embeddings): a tied parameter lives in one sharding unit, the enclosing one (FSDP2 refuses a
    parameter in two groups)."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
    kept = []
    for unit in units:
        inside = {id(m) for m in unit.modules()}
        if all(holders[id(p)] <= inside for p in unit.parameters()):
            kept.append(unit)
    return kept


def shard_units(model: nn.Module, spec: ShardSpec) -> list[nn.Module]:
    """The submodules to shard as units, in forward (registration) order."""
    if spec is None:
        return without_split_ties(model, default_units(model))
    if callable(spec) and not isinstance(spec, type):
        chosen = [m for name, m in model.named_modules() if name and spec(name, m)]
    else:
        classes = tuple(spec)
        if not classes or not all(isinstance(c, type) for c in classes):
            raise ValueError(
                f"shard_modules must be module classes or a predicate (name, module) -> bool, got {spec!r}"
            )
        chosen = [m for name, m in model.named_modules() if name and isinstance(m, classes)]
    return without_split_ties(model, [m for m in chosen if _has_params(m)])


def transform_units(
    model: nn.Module, units: list[nn.Module], activation_checkpointing: Any, compile: Any, device: torch.device
) -> list[nn.Module]:
    """Checkpoint, then compile, the units; returns the units to shard (wrappers where wrapped).
    A model without units compiles its root forward."""
    units = activation_ckpt.apply(model, activation_checkpointing, units)
    compile_units.apply(units or [model], compile, device)
    return units
