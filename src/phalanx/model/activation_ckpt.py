"""Activation checkpointing: chosen modules keep only their inputs for backward and recompute the
rest (non-reentrant `torch.utils.checkpoint`), trading compute for activation memory.

Applied before compile and sharding (checkpoint wrapper inside, then compile, then fully_shard, as
torchtitan does). The wrapper's state-dict hooks strip its name from keys, so checkpoints and
`px.load_model` see the model's own parameter names.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch
from torch import nn

# True: every sharding unit; module classes or class names; or a predicate on the module.
CheckpointSpec = Union[bool, Sequence[Union[type, str]], Callable[[nn.Module], bool], None]


def parse(value: object) -> CheckpointSpec:
    """The setting from a flag/env/YAML string: true/false or a comma list of module class names."""
    if not isinstance(value, str):
        return value  # type: ignore[return-value]
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("", "0", "false", "no", "off"):
        return False
    return [name.strip() for name in value.split(",") if name.strip()]


def _matcher(spec: CheckpointSpec) -> Callable[[nn.Module], bool]:
    if callable(spec) and not isinstance(spec, type):
        return spec  # type: ignore[return-value]
    items = list(spec)  # type: ignore[arg-type]
    if not items or not all(isinstance(i, (type, str)) for i in items):
        raise ValueError(
            f"activation_checkpointing must be True/False, module classes or class names, "
            f"or a predicate module -> bool; got {spec!r}"
        )
    classes = tuple(i for i in items if isinstance(i, type))
    names = {i for i in items if isinstance(i, str)}
    return lambda m: isinstance(m, classes) or type(m).__name__ in names


def _describe(spec: CheckpointSpec) -> str:
    if callable(spec) and not isinstance(spec, type):
        return "the predicate"
    return ", ".join(i if isinstance(i, str) else i.__name__ for i in spec)  # type: ignore[union-attr]


def select(model: nn.Module, spec: CheckpointSpec, units: list[nn.Module]) -> list[nn.Module]:
    """The modules to checkpoint, outermost only; a spec that matches nothing is an error."""
    if spec is None or spec is False:
        return []
    if spec is True:
        chosen = [u for u in units if u is not model]
        if not chosen:
            raise ValueError(
                "activation_checkpointing=True checkpoints each sharding unit, but this model "
                "has none besides the root. HINT: name the module classes to checkpoint."
            )
        return chosen
    match = _matcher(spec)
    chosen: list[nn.Module] = []
    for name, module in model.named_modules():
        if (
            name
            and match(module)
            and not any(m is not module and any(s is module for s in m.modules()) for m in chosen)
        ):
            chosen.append(module)
    if not chosen:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"activation_checkpointing: {_describe(spec)} matches no module of the model. "
            f"Module classes present: {', '.join(present)}"
        )
    return chosen


def replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` where `old` is registered in `model` (every place, for shared modules)."""
    places = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if child is old]
    for parent, name in places:  # found first: the wrapper holds `old` and must not be searched
        parent.register_module(name, new)


WRAPPED = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper holds the module under this name


def plain_name(name: str) -> str:
    """A parameter's name as the model had it before its blocks were wrapped for checkpointing
    (the wrapper's state_dict hooks drop the same segment)."""
    return name.replace(WRAPPED, "")


_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""the names transformers' blocks take their key/value cache under"""


def _no_cache_while_training(
    wrapper: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A transformers block appends its keys and values to the cache it is given: the recompute in
    backward would append them again and attend to twice the keys (Llama: "size of tensor a (16)
    must match ... (8)"). transformers' own checkpointing (GradientCheckpointingLayer) drops the
    cache for a training forward that will be recomputed; the wrapper does the same."""
    if not (wrapper.training and torch.is_grad_enabled()):
        return None
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(wrapper._checkpoint_wrapped_module, "_can_checkpoint_with_cache", False):
        changed.update({name: None for name in _CACHE_ARGUMENTS if changed.get(name) is not None})
    return args, changed


def apply(model: nn.Module, spec: CheckpointSpec, units: list[nn.Module]) -> list[nn.Module]:
    """Wrap the chosen modules in non-reentrant checkpoint wrappers; return `units` with each
    wrapped unit replaced by its wrapper (the wrapper is what gets compiled and sharded)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    chosen = select(model, spec, units)
    wrapped = {}
    for module in chosen:
        if module is model:
            raise ValueError("activation_checkpointing cannot wrap the root module; name its blocks instead")
        wrapper = checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        wrapper.register_forward_pre_hook(_no_cache_while_training, with_kwargs=True)
        replace_module(model, module, wrapper)
        wrapped[id(module)] = wrapper
    return [wrapped.get(id(u), u) for u in units]
