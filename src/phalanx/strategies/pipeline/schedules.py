"""torch's pipeline schedules by name, where each places its stages, and the microbatch rules.

One stage per rank: 1F1B, GPipe. Several stages per rank, placed in loops (rank r holds stages r,
r + pp, r + 2pp, ...): Interleaved1F1B, LoopedBFS, InterleavedZeroBubble. Two stages per rank
placed in a V (rank r holds stages r and 2pp - 1 - r, so the last stage is on rank 0):
ZBVZeroBubble, DualPipeV.
"""

from __future__ import annotations

from phalanx.config import names as setting_names
from phalanx.strategies.plan.parallel_plan import ParallelPlan

SINGLE = ("1F1B", "GPipe")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE + LOOPED + V_SHAPED
assert set(SCHEDULES) == set(setting_names.PP_SCHEDULES), "config/names.py lists every schedule"
DEFAULT_SCHEDULE = "1F1B"
DEFAULT_STAGES_PER_RANK = 2  # for the multi-stage schedules, as torchtitan's default


def schedule_name(name: str) -> str:
    """The schedule's canonical name (names are matched case-insensitively, as torch does)."""
    key = setting_names.canonical_pp_schedule(name) if isinstance(name, str) else name
    if key not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {', '.join(SCHEDULES)}; got {name!r}")
    return key


def default_microbatches(pp: int) -> int:
    """pp_microbatches when unset: 2 x pp, so that 1F1B's bubble is at most a third of the step."""
    return 2 * pp


def stages_per_rank(schedule: str, requested: int | None = None) -> int:
    """How many stages each rank runs under `schedule` (`requested` for the looped ones)."""
    schedule = schedule_name(schedule)
    if schedule in SINGLE:
        fixed = 1
    elif schedule in V_SHAPED:
        fixed = 2
    else:
        if requested is None:
            return DEFAULT_STAGES_PER_RANK
        if int(requested) != requested or requested < 2:
            raise ValueError(f"pp_schedule={schedule} runs at least 2 stages per rank; got {requested!r}")
        return int(requested)
    if requested is not None and requested != fixed:
        raise ValueError(
            f"pp_schedule={schedule} runs {fixed} stage(s) per rank; got {requested!r}. HINT: "
            f"for several stages per rank pick one of {', '.join(LOOPED)}"
        )
    return fixed


def stage_indices(schedule: str, pp_rank: int, pp: int, per_rank: int) -> tuple[int, ...]:
    """The stages `pp_rank` runs, in increasing order."""
    if schedule_name(schedule) in V_SHAPED:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(per_rank))


def last_stage_rank(schedule: str, pp: int) -> int:
    """The pipeline rank that runs the last stage (computes the loss, holds the output)."""
    return 0 if schedule_name(schedule) in V_SHAPED else pp - 1


def check_microbatches(schedule: str, pp: int, microbatches: int, batch_size: int | None = None) -> None:
    """Refuse a microbatch count the schedule cannot run, or one that does not divide the batch."""
    schedule = schedule_name(schedule)
    if int(microbatches) != microbatches or microbatches < pp:
        raise ValueError(
            f"pp_microbatches={microbatches} is smaller than pp={pp}: the pipeline would never fill. HINT: set "
            f"pp_microbatches to at least {pp} (default 2 x pp = {default_microbatches(pp)})."
        )
    if schedule == "DualPipeV" and microbatches < 2 * pp:
        raise ValueError(
            f"pp_schedule=DualPipeV needs pp_microbatches >= its {2 * pp} stages; got "
            f"{microbatches}. HINT: set pp_microbatches to {2 * pp} or more."
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"pp_schedule={schedule} runs microbatches in rounds of pp={pp}: pp_microbatches="
                f"{microbatches} does not split into {rounds} equal rounds. HINT: use a multiple of pp, "
                f"e.g. {rounds * pp}."
            )
    if batch_size is not None and batch_size % microbatches:
        raise ValueError(
            f"the batch of {batch_size} samples does not split into pp_microbatches={microbatches} equal "
            f"microbatches. HINT: make the per-rank batch size a multiple of {microbatches}, or set "
            f"pp_microbatches to a divisor of {batch_size} that is at least pp={pp}."
        )


def microbatches_for(schedule: str, pp: int, microbatches: int, batch_size: int) -> int:
    """How many equal microbatches a training batch of `batch_size` is cut into: `microbatches`
    when it divides the batch; else (a short last batch, a batch size pp_microbatches does not
    divide) the most equal microbatches, at most `microbatches`, the schedule can run (fewer than
    pp cannot fill the pipeline), or failing that the fewest above it. Every sample is trained on,
    and the step's loss, the mean of the microbatches' means, is the batch's mean as one process
    computes it. ValueError for a batch no count fits (fewer samples than pp)."""
    if batch_size % microbatches == 0:
        return microbatches
    fits = []
    for count in range(pp, batch_size + 1):
        if batch_size % count:
            continue
        try:
            check_microbatches(schedule, pp, count)
        except ValueError:
            continue
        fits.append(count)
    if not fits:
        raise ValueError(
            f"a training batch of {batch_size} sample(s) cannot be cut into equal microbatches that "
            f"pp_schedule={schedule_name(schedule)} with pp={pp} can run (at least {pp}). HINT: drop the short "
            "last batch (DataLoader(..., drop_last=True)), or use a batch size that is a multiple of "
            f"pp_microbatches={microbatches}."
        )
    below = [c for c in fits if c <= microbatches]
    return max(below) if below else min(fits)


def rank_labels(plan: ParallelPlan, schedule: str) -> list[str] | None:
    """Per global rank, the pipeline stage(s) it runs (`pipeline stage 1 of 2`), for the watchdog's
    reports; None when the plan has no pipeline."""
    if plan.pp == 1:
        return None
    schedule = schedule_name(schedule)
    per_rank = stages_per_rank(schedule)
    labels = []
    for rank in range(plan.world_size):
        stages = stage_indices(schedule, plan.coordinates(rank)["pp"], plan.pp, per_rank)
        which = ", ".join(map(str, stages))
        labels.append(f"pipeline stage{'s' if len(stages) > 1 else ''} {which} of {plan.pp * per_rank}")
    return labels
