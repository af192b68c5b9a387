"""Straggler attribution: which rank the others wait for, in which phase, by how much.

A synchronous job runs at the speed of its slowest rank, and every rank's step takes about as long:
the others spend the straggler's extra time waiting inside a collective (DDP's all-reduce in
backward, FSDP's all-gathers in forward...). So per step, each rank's phase times are added up in
step order (anatomy.ORDER) and compared with the median rank at each point: the rank furthest ahead
of the median at some point of the step fell behind first: it is that step's slowest rank, and the
phase where its own time exceeds the median's is where its excess is spent. Waiting ranks catch up
inside the collective and are never ahead there.

A rank is named when it was the slowest in at least `START_SHARE` of the last `WINDOW` steps seen
on every rank and its median lead is at least `MIN_MS` and `MIN_FRACTION` of the median step; it
stops being named when either falls well below (`END_SHARE`, half the lead): one slow step, or a
machine whose load moves between ranks, names nobody. "Median" is the lower median: with two ranks,
the faster one.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from phalanx.observe.anatomy import rank_order

WINDOW = 100
MIN_STEPS = 30
START_SHARE, END_SHARE = 0.8, 0.6
MIN_MS, MIN_FRACTION = 5.0, 0.05

StepTimes = Mapping[str, float]  # column -> seconds, one rank's one step


@dataclass(frozen=True)
class Assessment:
    """The most often slowest rank over the last steps, and its figures."""

    rank: int
    share: float  # of the steps, where it was the slowest
    num_steps: int
    lead_ms: float  # median over the steps of how far it fell behind the median rank
    phase: str  # where its excess time is spent
    excess_ms: float  # mean per step of its time in `phase` over the median rank's
    step_ms: float  # the median rank's median step

    @property
    def threshold_ms(self) -> float:
        return max(MIN_MS, MIN_FRACTION * self.step_ms)


def _lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def assess(ranks: Sequence[Mapping[int, StepTimes]], window: int = WINDOW) -> Assessment | None:
    """Judge the last `window` steps that every rank has reported (`ranks[r][step]`); None with
    fewer than MIN_STEPS of them or fewer than two ranks."""
    if len(ranks) < 2:
        return None
    common = set(ranks[0])
    for steps in ranks[1:]:
        common &= set(steps)
    chosen = sorted(common)[-window:]
    if len(chosen) < min(MIN_STEPS, window):
        return None
    slowest: list[int] = []
    leads: list[list[float]] = [[] for _ in ranks]
    excess: list[dict[str, float]] = [{} for _ in ranks]
    step_ms: list[float] = []
    for step in chosen:
        times = [steps[step] for steps in ranks]
        order = rank_order({p for t in times for p in t})
        running = [0.0] * len(ranks)
        best = [0.0] * len(ranks)
        for phase in order:
            own = [t.get(phase, 0.0) for t in times]
            median = _lower_median(own)
            for r, value in enumerate(own):
                excess[r][phase] = excess[r].get(phase, 0.0) + value - median
                running[r] += value
            median_running = _lower_median(running)
            for r in range(len(ranks)):
                best[r] = max(best[r], running[r] - median_running)
        for r, lead in enumerate(best):
            leads[r].append(lead * 1000)
        slowest.append(max(range(len(ranks)), key=lambda r: best[r]))
        step_ms.append(_lower_median(running) * 1000)
    rank = max(range(len(ranks)), key=slowest.count)
    phase = max(excess[rank], key=lambda p: excess[rank][p])
    return Assessment(rank=rank, share=slowest.count(rank) / len(chosen), num_steps=len(chosen),
                      lead_ms=statistics.median(leads[rank]), phase=phase,
                      excess_ms=1000 * excess[rank][phase] / len(chosen), step_ms=statistics.median(step_ms))


@dataclass(frozen=True)
class Straggler:
    """A rank named as the straggler."""

    rank: int
    host: str
    local_rank: int
    phase: str
    ms_per_step: float
    share: float
    num_steps: int

    @property
    def message(self) -> str:
        return (f"straggler: rank {self.rank} (host {self.host}, local rank {self.local_rank}) slowest in "
                f"{round(100 * self.share)} % of the last {self.num_steps} steps: "
                f"+{round(self.ms_per_step)} ms/step in {self.phase}")

    def as_status(self) -> dict[str, object]:
        """The dashboard's `straggler` field."""
        return {"rank": self.rank, "phase": self.phase, "ms_per_step": round(self.ms_per_step, 1)}


class StragglerWatch:
    """Names a straggler when it starts and lets it go when it ends (with some hysteresis)."""

    def __init__(self) -> None:
        self.current: Straggler | None = None

    def update(self, seen: Assessment | None, where: Sequence[tuple[str, int]]) -> list[str]:
        """Feed the latest assessment (`where[r]` = (host, local_rank)); returns the lines to log."""
        lines = []
        if self.current is not None:
            if seen is not None and seen.rank == self.current.rank and seen.share >= END_SHARE \
                    and seen.lead_ms >= seen.threshold_ms / 2:
                self.current = _named(seen, where)  # still the one: its latest figures
                return lines
            lines.append(f"{self.current.message.replace('straggler:', 'straggler ended:', 1)}"
                         f" (now slowest in {round(100 * seen.share) if seen and seen.rank == self.current.rank else 0} %)")
            self.current = None
        if seen is not None and seen.share >= START_SHARE and seen.lead_ms >= seen.threshold_ms \
                and seen.excess_ms > 0:
            self.current = _named(seen, where)
            lines.append(self.current.message)
        return lines


def _named(seen: Assessment, where: Sequence[tuple[str, int]]) -> Straggler:
    host, local_rank = where[seen.rank]
    return Straggler(seen.rank, host, local_rank, seen.phase, seen.excess_ms, seen.share, seen.num_steps)
