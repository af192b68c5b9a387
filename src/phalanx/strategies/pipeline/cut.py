"""Cutting a model into the stages one pipeline rank runs, in place, names kept.

The units this rank does not own are replaced by `PassThrough` modules (a ModuleList keeps its
indices), so the rank's model holds only its own parameters, under the model's own names
(`layers.5.attn.q.weight` stays that on stage 1), and the user's forward runs unchanged: on the
first stage the input is the token ids and the trailing units pass the hidden state out; on later
stages the leading units pass the received hidden state in.

A rank that runs several stages (interleaved and V schedules) gets one view per stage: a copy of
the model's skeleton (root and the containers down to the blocks) whose units are the rank model's
own modules for that stage and pass-throughs elsewhere. Parameters are shared, never copied: the
rank model stays the one object for the optimizer and the state dict.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from phalanx.strategies.pipeline.chain import ModelChain
from phalanx.strategies.pipeline.split import Stages


class PassThrough(nn.Module):
    """Stands in for a unit another pipeline stage owns: returns its input unchanged (and keeps it
    as `handed` until the next call: what a later stage must receive, whatever the model's forward
    does to it after this unit)."""

    def __init__(self, owner: int | None = None):
        super().__init__()
        self.owner = owner
        self.handed: Any = None

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self.handed = x
        return x

    def extra_repr(self) -> str:
        return "" if self.owner is None else f"on stage {self.owner}"


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank runs after the cut."""

    model: nn.Module
    """the user's model, cut in place: this rank's units, pass-throughs for the rest."""
    stages: tuple[nn.Module, ...]
    """the module of each stage this rank runs (the model itself when it runs one)."""
    stage_indices: tuple[int, ...]
    num_stages: int
    units: tuple[str, ...]
    """the names of the units this rank owns."""


def _check_boundary_output(stage: int):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor):
            raise ValueError(
                f"pipeline stage {stage} returned a {type(output).__name__}, but the pipeline sends one tensor "
                "from stage to stage: the unit that ends this stage must return the hidden state alone "
                "(a block returning a tuple cannot end a stage)."
            )

    return hook


def _view(model: nn.Module, stages: Stages, index: int) -> nn.Module:
    """A skeleton copy of the model running only stage `index`'s units, sharing their modules."""
    memo: dict[int, Any] = {}  # deepcopy returns memo[id(x)] for x instead of copying it
    for i, stage in enumerate(stages):
        for name in stage:
            unit = model.get_submodule(name)
            memo[id(unit)] = unit if i == index else PassThrough(owner=i)
    return copy.deepcopy(model, memo)


def cut_model(
    model: nn.Module, chain: ModelChain, stages: Stages, stage_indices: Sequence[int], views: bool = True
) -> RankStages:
    """Cut `model` in place down to the stages `stage_indices`; returns the rank's stage modules.
    `views=False` leaves `stages` empty: build them with `stage_modules` once the units have been
    transformed (activation checkpointing and tensor parallel replace or change the unit modules)."""
    num_stages = len(stages)
    indices = tuple(sorted(stage_indices))
    if not indices or indices[0] < 0 or indices[-1] >= num_stages or len(set(indices)) != len(indices):
        raise ValueError(f"stage indices {list(stage_indices)} are not distinct stages of 0..{num_stages - 1}")
    owned = tuple(name for i in indices for name in stages[i])
    for i, stage in enumerate(stages):
        if i not in indices:
            for name in stage:
                model.set_submodule(name, PassThrough(owner=i))
    rank = RankStages(model=model, stages=(), stage_indices=indices, num_stages=num_stages, units=owned)
    return dataclasses.replace(rank, stages=stage_modules(rank, stages)) if views else rank


def stage_modules(rank: RankStages, stages: Stages) -> tuple[nn.Module, ...]:
    """The module of each stage `rank` runs: the cut model itself for one stage, else a view of it
    per stage, holding the units as they are now; each checks that it hands on one tensor."""
    indices = rank.stage_indices
    if len(indices) == 1:
        modules: tuple[nn.Module, ...] = (rank.model,)
    else:
        modules = tuple(_view(rank.model, stages, i) for i in indices)
    for index, module in zip(indices, modules):
        if index != rank.num_stages - 1:
            module.register_forward_hook(_check_boundary_output(index))
    return modules
