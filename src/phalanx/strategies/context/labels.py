"""transformers' `labels=` under cp: a causal LM shifts its labels inside its forward, which on a
rank's part of a row would pair each chunk's last token with the next chunk's first token held
here (one wrong pair per cut), and averages over this rank's targets only. So the labels are
shifted over the whole row before the cut and handed to the model as `shift_labels` (transformers'
ForCausalLMLoss takes them as they are), and `num_items_in_batch` makes each rank's loss its
share of the whole row's mean: Σ its targets' losses / (the row's target count / cp). The cp ranks'
mean (the gradient average, px.reduce) is then the whole row's mean loss, as one process's."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.strategies.context.shard import IGNORE_INDEX


def shifts_labels(model: nn.Module) -> bool:
    """Whether `model` is a transformers causal LM whose loss shifts `labels` (ForCausalLMLoss)."""
    return getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith("ForCausalLM")


def shift_before_cut(inputs: Any, cp_size: int) -> Any:
    """`inputs` with `labels` [batch, seq] shifted over the whole row into `shift_labels` (the last
    position IGNORE_INDEX, as transformers pads them) and `num_items_in_batch` set to the row's
    target count / cp; other inputs unchanged."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        return inputs
    labels, shifted = inputs.get("labels"), inputs.get("shift_labels")
    if shifted is None:
        if not isinstance(labels, torch.Tensor) or labels.shape != inputs["input_ids"].shape:
            return inputs
        shifted = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    fields = dict(inputs)
    count = fields.get("num_items_in_batch")
    count = (shifted != IGNORE_INDEX).sum() if count is None else torch.as_tensor(count)
    # the model computes a loss only when labels is given; with shift_labels it never reads them
    fields.update(labels=shifted, shift_labels=shifted, num_items_in_batch=count.float() / cp_size)
    return fields
