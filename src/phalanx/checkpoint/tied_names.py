"""A tied parameter (one parameter under several names: tied input/output embeddings) is stored
once in a checkpoint, under its canonical name: the first of its names in the whole model's
registration order (`model.embed_tokens.weight`, not `lm_head.weight`), which is the name torch's
optimizer state dict gives it and the one transformers keeps when it saves a tied model.

The names are taken from the user's model before prepare: a pipeline stage may hold the parameter
under one of its other names only (the last stage's `lm_head.weight`), and still saves it under
the canonical name and loads it back from there, so one checkpoint moves between pp and the
layouts where the parameter is one (one process, ddp, zero3, tp).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from torch import nn

_OPTIM_PREFIXES = ("state.", "param_groups.")  # the flattened optimizer state's keys: state.<name>.exp_avg


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter -> its canonical name (the first one); {} untied."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def saved_key(key: str, tied: Mapping[str, str]) -> str:
    """The checkpoint's key for a live state-dict key (a model key, or a flattened optimizer key
    `state.<name>.<what>` / `param_groups.<name>.<what>`): its tied name replaced by the canonical one."""
    if key in tied:
        return tied[key]
    for prefix in _OPTIM_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            for alias, canonical in tied.items():
                if rest.startswith(f"{alias}."):
                    return f"{prefix}{canonical}{rest[len(alias) :]}"
    return key


def to_saved(state: Mapping[str, Any], tied: Mapping[str, str]) -> dict[str, Any]:
    """`state` with each tied parameter's entries once, under the canonical name (where a rank holds
    the parameter under several names, the values are the same tensor)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        out.setdefault(saved_key(key, tied), value)
    return out


def from_saved(saved: Mapping[str, Any], live_keys: Iterable[str], tied: Mapping[str, str]) -> dict[str, Any]:
    """The live keys' values from what `to_saved`'s keys were filled with."""
    return {key: saved[saved_key(key, tied)] for key in live_keys}
