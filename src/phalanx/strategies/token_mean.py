"""transformers' `labels=` across the data-parallel ranks: the loss is the mean over every rank's target
tokens, as one process takes it over the global batch.

A causal LM called with `labels=` returns the mean over its own batch's targets (-100 ignored). With
padding, ranks hold different numbers of real tokens, and averaging each rank's mean (DDP's gradient
average) weighs a rank's 3 tokens like another's 300: a grad norm 1.6743 where one process has 1.8203.
transformers' Trainer counts the targets over the devices and passes `num_items_in_batch`
(`average_tokens_across_devices`); so does phalanx, at the prepared model's forward: one all-reduce of
the count over the ranks gradients are averaged over, and `num_items_in_batch` = that count / those
ranks, so each rank's loss is its summed loss / (the global count / ranks) and the ranks' average is the
global token mean. The loss a rank returns is then its share of that mean (`px.reduce(loss)` is the
global mean, as one process's loss).

Only in training (the model in train mode, gradients enabled: every rank takes the same forwards), when
the script passes no `num_items_in_batch` of its own (cp's cut passes its own: context/labels.py); inside
`px.uneven_inputs`' Join, over the ranks still stepping. `average_tokens_across_ranks=False` keeps
per-rank means. Under pp the stages run inside px.forward_backward (the model's own forward is refused).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.data.uneven import current_join
from phalanx.strategies.context.labels import shifts_labels
from phalanx.strategies.context.shard import IGNORE_INDEX


def applies(model: nn.Module) -> bool:
    """Whether `model` (unwrapped) is a transformers causal LM whose forward takes `num_items_in_batch`."""
    if not shifts_labels(model):
        return False
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def target_count(inputs: dict[str, Any]) -> torch.Tensor | None:
    """The targets a causal LM's loss averages over in these keyword inputs: `shift_labels` as given, or
    `labels` shifted by one inside the model (its first position is never a target); None without labels."""
    shifted = inputs.get("shift_labels")
    if isinstance(shifted, torch.Tensor):
        return (shifted != IGNORE_INDEX).sum()
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        return (labels[..., 1:] != IGNORE_INDEX).sum()
    return None


def average_tokens_across_ranks(
    model: nn.Module, group: Callable[[], Any], ranks: int, counted: Callable[[bool], None]
) -> None:
    """Give the prepared `model` a forward pre-hook that passes `num_items_in_batch` = the targets of all
    `ranks` (the process group `group()`) / ranks; `counted(whether it did)` is told at each training forward."""

    def count_across_ranks(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not module.training or not torch.is_grad_enabled():
            return None
        count = None if kwargs.get("num_items_in_batch") is not None else target_count(kwargs)
        # a batch of no rows (the short last step's padding) counts 0 here and is not said to be weighed:
        # the shadow row data/shadow_rows.py runs after this hook is then weighed 0 by px.backward
        counted(count is not None and _rows(kwargs) > 0)
        if count is None:
            return None
        total = count.to(torch.float64)  # exact for any count, and summed alike on gloo and NCCL
        join = current_join()
        if join is not None:  # px.uneven_inputs' Join: over the ranks still stepping
            total = join.reduce(total, "sum", total.device)
        else:
            dist.all_reduce(total, group=group())
        return args, {**kwargs, "num_items_in_batch": (total / ranks).to(torch.float32)}

    # first of the pre-hooks: it counts the batch as the script gave it (before a shadow row is put in)
    model.register_forward_pre_hook(count_across_ranks, with_kwargs=True, prepend=True)


def _rows(inputs: dict[str, Any]) -> int:
    """The rows of the labels (or shift_labels) the script passed."""
    labels = inputs.get("shift_labels", inputs.get("labels"))
    return int(labels.shape[0]) if isinstance(labels, torch.Tensor) and labels.dim() > 0 else 0
