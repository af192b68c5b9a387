"""A batch of no rows through a transformers model: a shadow row in, no rows out.

phalanx hands a rank a batch of no rows where one process has no samples for it: the short last
batch of an epoch leaves a rank nothing but padding repeats, cut to no rows (data/loader.py), and a
rank out of data under FSDP2 runs on batches of no rows (shadow_batches.py). Its forward and
backward still run, to meet the peers' collectives, and its loss weighs 0. A plain module takes no
rows; transformers' attention does not ("cannot reshape tensor of 0 elements": it reshapes by -1).

So on a prepared transformers model, a call whose batched tensors all have no rows runs on one
shadow row instead: each such tensor becomes one row of zeros (ones for an `*mask` argument: a row
that attends), and each batched tensor of the output is cut back to no rows, keeping its autograd
edge. Every parameter takes part, as in the peers' forward (DDP's and FSDP2's hooks see them all),
and the gradients are zero: the loss over no rows is weighed 0 (`BatchInfo.weigh`), and a loss
the model computed from `labels=` is the shadow row's, weighed 0 the same way.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

_SHADOWED = "_phalanx_shadow_row"  # set on the model between the pre-hook and the hook of one call


def install(model: nn.Module, inner: nn.Module) -> None:
    """Give the prepared `model` (`inner`: the user's module inside any wrapper) the shadow row,
    where `inner` is a transformers model."""
    if "transformers" not in sys.modules:  # then the model is no PreTrainedModel: nothing to import
        return
    from transformers import PreTrainedModel

    if isinstance(inner, PreTrainedModel):
        model.register_forward_pre_hook(_shadow_inputs, with_kwargs=True, prepend=True)
        model.register_forward_hook(_cut_outputs, always_call=True)


def _no_rows(args: tuple, kwargs: dict) -> bool:
    """Whether the call's batched tensors (one dimension or more) all have no rows (and it has some)."""
    rows = [t.shape[0] for t in _tensors((args, kwargs)) if t.dim() > 0]
    return bool(rows) and not any(rows)


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, tree)
    return found


def _one_row(t: torch.Tensor, name: str = "") -> torch.Tensor:
    if t.dim() == 0 or t.shape[0] != 0:
        return t
    return t.new_ones((1, *t.shape[1:])) if name.endswith("mask") else t.new_zeros((1, *t.shape[1:]))


def _shadow_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    module.__dict__.pop(_SHADOWED, None)
    if not _no_rows(args, kwargs):
        return None
    module.__dict__[_SHADOWED] = True
    shadow_args = tree_map_only(torch.Tensor, _one_row, args)
    shadow_kwargs = {k: tree_map_only(torch.Tensor, lambda t, k=k: _one_row(t, k), v) for k, v in kwargs.items()}
    return shadow_args, shadow_kwargs


def _cut_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
    if not module.__dict__.pop(_SHADOWED, False):
        return None
    cut = {k: _cut(v) for k, v in output.items()} if isinstance(output, dict) else None
    if cut is not None:
        for k, v in cut.items():  # transformers' ModelOutput: its attributes and its items
            output[k] = v
        return output
    return tree_map_only(torch.Tensor, _cut, output)


def _cut(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 1:
        return value[:0]
    return value
