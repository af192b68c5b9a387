"""Parameters tied across pipeline stages (a tied embedding: the input embedding on the first stage,
the output projection on the last), as Megatron keeps them: every stage whose units hold the
parameter keeps a copy (equal at the start: the same initialisation or the same weights loaded),
and before each optimizer step the copies' gradients are summed over the pipeline ranks holding
them, so each copy takes the one-process gradient and the same step, and they stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies.layout import Layout
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import schedules
from phalanx.strategies.pipeline.chain import ModelChain, shared_parameters
from phalanx.strategies.pipeline.split import Stages


@dataclass(frozen=True)
class TiedParam:
    """A parameter held by units on more than one pipeline rank."""

    name: str
    """its name in the first holding unit (`model.embed_tokens.weight`)."""
    holders: tuple[str, ...]
    """the parameter's names in each holding unit."""
    pp_ranks: tuple[int, ...]
    """the pipeline ranks whose stages hold it."""


def find_tied(
    model: nn.Module, chain: ModelChain, stages: Stages, schedule: str, plan: ParallelPlan
) -> list[TiedParam]:
    """The parameters of `model` (before the cut) that land on more than one of the plan's pipeline ranks."""
    pp = plan.pp
    per_rank = schedules.stages_per_rank(schedule)
    rank_of_stage = {s: r for r in range(pp) for s in schedules.stage_indices(schedule, r, pp, per_rank)}
    stage_of_unit = {name: i for i, stage in enumerate(stages) for name in stage}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    tied = []
    for pname, units in shared_parameters(model, chain).items():
        ranks = tuple(sorted({rank_of_stage[stage_of_unit[u]] for u in units}))
        if len(ranks) < 2:
            continue
        param = model.get_parameter(pname)
        holders = tuple(f"{u}.{n}" for u in units for n, p in model.get_submodule(u).named_parameters() if p is param)
        tied.append(TiedParam(names.get(id(param), pname), holders, ranks))
    return tied


class TiedGradients:
    """Sums the gradients of the tied parameters over the pipeline ranks that hold them."""

    def __init__(self, model: nn.Module, tied: list[TiedParam], layout: Layout):
        self.model = model
        self.tied = tied
        # one group per set of pipeline ranks (each pipeline's own, made by all): the layout's
        self.groups: dict[tuple[int, ...], Any] = {
            ranks: layout.pipeline_group(ranks) for ranks in sorted({t.pp_ranks for t in tied})
        }
        self.pp_rank = layout.mesh("pp").get_local_rank()

    def _param(self, t: TiedParam) -> torch.Tensor | None:
        for holder in t.holders:
            try:
                return self.model.get_parameter(holder)
            except AttributeError:  # that holder's unit is another rank's pass-through
                continue
        return None

    @torch.no_grad()
    def sync(self) -> None:
        """Once per optimizer step, after the last backward: sum the holders' gradients (a frozen
        parameter is frozen on every holder; an unused one counts as a zero gradient)."""
        for t in self.tied:
            group = self.groups[t.pp_ranks]
            param = self._param(t) if group is not None else None
            if param is None or not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            dist.all_reduce(grad._local_tensor if hasattr(grad, "_local_tensor") else grad, group=group)

    def counted_elsewhere(self) -> list[torch.Tensor]:
        """The tied parameters this rank holds that a lower pipeline rank counts in the norm."""
        out = []
        for t in self.tied:
            param = self._param(t) if self.pp_rank != t.pp_ranks[0] else None
            if param is not None:
                out.append(param)
        return out
