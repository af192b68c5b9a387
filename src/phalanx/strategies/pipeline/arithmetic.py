"""What a pipeline layout implies, without running it: bytes per stage, the bubble, and how many
microbatches' activations each rank holds at its peak (for `phalanx plan`). Pure functions.

Bubble: the fraction of a step a rank idles while the pipeline fills and drains. GPipe and 1F1B:
(pp - 1) / (microbatches + pp - 1); the interleaved 1F1B with v stages per rank divides the fill
by v: (pp - 1) / (v * microbatches + pp - 1) (Narayanan et al., 2021). Zero-bubble and
breadth-first schedules are not modelled (None).

Activations in flight, in "stage-microbatches" (one stage's saved activations for one
microbatch), at a rank's peak, following the order torch's schedules run: GPipe runs every forward
before any backward (all microbatches); 1F1B lets pipeline rank r run pp - r forwards ahead (at most
the microbatches); Interleaved1F1B runs its warm-up forwards, (v - 1) x (microbatches per round) +
2 (pp - 1 - r), plus one; LoopedBFS all v x microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from phalanx.strategies.pipeline import schedules as names


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float | None:
    """The idle fraction of a step the schedule implies; None where not modelled."""
    schedule = names.schedule_name(schedule)
    if schedule in names.SINGLE:
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
    return None


def in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> tuple[int, ...] | None:
    """Per pipeline rank: the stage-microbatches whose activations it holds at its peak."""
    schedule = names.schedule_name(schedule)
    v, m = stages_per_rank, microbatches
    if schedule == "GPipe":
        return (m,) * pp
    if schedule == "1F1B":
        return tuple(min(m, pp - r) for r in range(pp))
    if schedule == "Interleaved1F1B":
        per_round = m // max(1, m // pp)
        return tuple(min((v - 1) * per_round + 2 * (pp - 1 - r) + 1, v * m) for r in range(pp))
    if schedule == "LoopedBFS":
        return (v * m,) * pp
    return None


@dataclass(frozen=True)
class PipelineFigures:
    """A pipeline layout's figures: per stage and per pipeline rank."""

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int
    stage_param_bytes: tuple[int, ...]
    rank_param_bytes: tuple[int, ...]
    bubble: float | None
    in_flight: tuple[int, ...] | None
    rank_activation_bytes: tuple[int, ...] | None
    """in_flight x the bytes one stage-microbatch saves (when given)."""


def pipeline_figures(
    stage_params: Sequence[int],
    schedule: str,
    pp: int,
    microbatches: int | None = None,
    bytes_per_param: int = 4,
    activation_bytes_per_stage_microbatch: int | None = None,
) -> PipelineFigures:
    """Figures for stages of `stage_params` parameters each (split.stage_params) run under `schedule`."""
    schedule = names.schedule_name(schedule)
    m = microbatches or names.default_microbatches(pp)
    per_rank = len(stage_params) // pp
    if per_rank * pp != len(stage_params) or per_rank != names.stages_per_rank(
        schedule, per_rank if schedule in names.LOOPED else None
    ):
        raise ValueError(f"pp_schedule={schedule} with pp={pp} does not run {len(stage_params)} stages")
    stage_bytes = tuple(p * bytes_per_param for p in stage_params)
    rank_bytes = tuple(sum(stage_bytes[i] for i in names.stage_indices(schedule, r, pp, per_rank)) for r in range(pp))
    flight = in_flight(schedule, pp, m, per_rank)
    acts = (
        tuple(n * activation_bytes_per_stage_microbatch for n in flight)
        if flight is not None and activation_bytes_per_stage_microbatch is not None
        else None
    )
    return PipelineFigures(
        schedule, pp, m, per_rank, stage_bytes, rank_bytes, bubble_fraction(schedule, pp, m, per_rank), flight, acts
    )
