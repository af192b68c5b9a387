"""`phalanx plan --pp N`: where the pipeline cuts a (meta-device) model, the parameter bytes of each
pipeline rank's stages, the schedule's bubble, and with --input the activations each rank holds at
its peak: one microbatch's through its stages times the microbatches in flight the schedule keeps
(strategies/pipeline/arithmetic.py). The strategies' table then plans the largest rank's stages
over its data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import arithmetic, schedules
from phalanx.strategies.pipeline.model_plan import model_chain
from phalanx.strategies.pipeline.split import split_for_schedule, stage_params


@dataclass
class PipelinePlan:
    units: tuple[str, ...]
    """the units of the pipeline rank holding the most parameter bytes."""
    report: str


def _bytes(model: nn.Module, units: tuple[str, ...]) -> int:
    return sum(p.numel() * p.element_size() for u in units for p in model.get_submodule(u).parameters())


def plan_pipeline(
    model: nn.Module,
    plan: ParallelPlan,
    schedule: str,
    microbatches: int | None,
    split: list[str] | None,
    measure: Callable[[list[nn.Module]], Any] | None,
    fb: Callable[[float], str],
) -> PipelinePlan:
    """The pipeline section of the report on `plan`'s pipeline ranks. `measure(units)`: the activation
    estimate of one rank's batch with those modules as units (plan/activations.py), or None without --input."""
    pp = plan.pp
    schedule = schedules.schedule_name(schedule)
    per_rank = schedules.stages_per_rank(schedule)
    m = microbatches or schedules.default_microbatches(pp)
    schedules.check_microbatches(schedule, pp, m)
    chain = model_chain(model)
    stages = split_for_schedule(chain, plan, schedule, split)
    figures = arithmetic.pipeline_figures(stage_params(chain, stages), schedule, pp, m)
    stage_bytes = [_bytes(model, stage) for stage in stages]
    per_microbatch: list[int] | None = None
    if measure is not None:  # each unit's saved bytes for the whole batch; a microbatch is 1/m of it
        acts = measure([model.get_submodule(u) for u in chain.names])
        saved = dict(zip(chain.names, acts.unit_saved))
        per_microbatch = [
            (sum(saved[u] for u in stage) + (acts.outside if i == len(stages) - 1 else 0)) // m
            for i, stage in enumerate(stages)
        ]
    bubble = f"{figures.bubble:.0%} of a step" if figures.bubble is not None else "not modelled for this schedule"
    lines = [
        f"pipeline pp={pp}, {schedule}, {m} microbatches of each rank's batch, {per_rank} stage(s) per pipeline "
        f"rank; bubble {bubble}:"
    ]
    header = f"  {'rank':>4s}  {'stages':8s} {'parameters':>11s}"
    if per_microbatch is not None:
        header += f"  {'activations: per microbatch x in flight = peak':>46s}"
    lines.append(header + "  units")
    rank_units = []
    for r in range(pp):
        held = schedules.stage_indices(schedule, r, pp, per_rank)
        units = tuple(u for i in held for u in stages[i])
        rank_units.append(units)
        line = f"  {r:4d}  {', '.join(map(str, held)):8s} {fb(sum(stage_bytes[i] for i in held)):>11s}"
        if per_microbatch is not None and figures.in_flight is not None:
            one = max(per_microbatch[i] for i in held)  # the schedule keeps this many of its stages' microbatches
            line += f"  {fb(one):>24s} x {figures.in_flight[r]:2d} = {fb(one * figures.in_flight[r]):>12s}"
        elif per_microbatch is not None:
            line += f"  {'(in flight: not modelled)':>46s}"
        lines.append(f"{line}  {_shorten(units)}")
    largest = max(range(pp), key=lambda r: _bytes(model, rank_units[r]))
    lines.append(
        f"the strategies below hold pipeline rank {largest}'s stages (the most parameters) over its data-parallel ranks"
    )
    return PipelinePlan(rank_units[largest], "\n".join(lines))


def _shorten(units: tuple[str, ...]) -> str:
    return ", ".join(units) if len(units) <= 4 else f"{units[0]}, {units[1]} ... {units[-1]} ({len(units)} units)"
