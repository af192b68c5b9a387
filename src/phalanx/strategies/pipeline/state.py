"""State dicts of a pipeline rank under the model's own parameter names, for DCP and export.

A rank saves only its own units (its stage modules share the cut model's names: `layers.5.*` on
stage 1), so the saves of all stages together are the whole model, and DCP loads them into any
layout (one process, zero3, another pp) by name. The optimizer state is *flattened*
(`state.<name>.exp_avg`, `param_groups.<name>.lr`: one key per parameter, as torchtitan saves under
pp). torch's nested form saves `param_groups` as one list per rank; the stages' lists differ (each
names its own parameters) and DCP keeps one rank's copy (measured: after loading a pp2 save into the
whole model the list names stage 1's parameters only). torch's loader then takes the groups' order
from the live optimizer, which happens to work when every stage's optimizer has the same groups;
the flat form needs no such luck.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""The options every layout must save and load with for checkpoints to move into and out of pp."""


def get_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} of this rank's units, names as in the whole model, for dcp.save."""
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=OPTIONS)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
    return state


def set_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Load what dcp.load filled into `get_state(...)`'s dict back into the model and optimizer."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=OPTIONS)


def gather_full_state_dict(model: nn.Module, pp_group: Any, dst: int = 0) -> dict[str, torch.Tensor]:
    """The whole model's full weights (CPU tensors, the model's names) on pipeline rank `dst`; {}
    elsewhere. Every rank of the pipeline calls it, and, under FSDP2, every rank of each stage's
    data-parallel group (each shard is gathered over it first)."""
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    mine = {}
    for name, value in get_model_state_dict(model).items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        mine[name] = value.detach().cpu()
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, dst), group=group)
    if gathered is None:
        return {}
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        full.update(part)
    return full
