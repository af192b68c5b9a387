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

from phalanx.logging.printable import printable
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


@dataclass(frozen=True)
class StepVerdict:
    """One step judged: how far each rank fell behind the median, and its excess per column."""

    leads_ms: tuple[float, ...]
    excess_ms: tuple[dict[str, float], ...]
    step_ms: float

    @property
    def slowest(self) -> int:
        return max(range(len(self.leads_ms)), key=self.leads_ms.__getitem__)


def judge_step(times: Sequence[StepTimes]) -> StepVerdict:
    """Judge one step from each rank's column times."""
    order = rank_order({p for t in times for p in t})
    num_ranks = len(times)
    running = [0.0] * num_ranks
    best = [0.0] * num_ranks
    excess: list[dict[str, float]] = [{} for _ in times]
    for phase in order:
        own = [t.get(phase, 0.0) for t in times]
        median = _lower_median(own)
        for r, value in enumerate(own):
            excess[r][phase] = 1000 * (value - median)
            running[r] += value
        median_running = _lower_median(running)
        for r in range(num_ranks):
            best[r] = max(best[r], running[r] - median_running)
    return StepVerdict(tuple(1000 * b for b in best), tuple(excess), 1000 * _lower_median(running))


class Judge:
    """Judges each step once, when every rank has reported it, and assesses the last `window`."""

    def __init__(self, num_ranks: int, window: int = WINDOW):
        self.num_ranks, self.window = num_ranks, window
        self.steps: dict[int, StepVerdict] = {}

    def add(self, ranks: Sequence[Mapping[int, StepTimes]]) -> None:
        common = set(ranks[0])
        for steps in ranks[1:]:
            common &= set(steps)
        for step in common - set(self.steps):
            self.steps[step] = judge_step([steps[step] for steps in ranks])
        for old in sorted(self.steps)[: -self.window]:
            del self.steps[old]

    def assess(self) -> Assessment | None:
        """The most often slowest rank of the last `window` judged steps; None with fewer than
        MIN_STEPS of them or fewer than two ranks."""
        chosen = [self.steps[s] for s in sorted(self.steps)[-self.window :]]
        if self.num_ranks < 2 or len(chosen) < min(MIN_STEPS, self.window):
            return None
        slowest = [v.slowest for v in chosen]
        rank = max(range(self.num_ranks), key=slowest.count)
        excess: dict[str, float] = {}
        for v in chosen:
            for phase, ms in v.excess_ms[rank].items():
                excess[phase] = excess.get(phase, 0.0) + ms
        phase = max(excess, key=excess.__getitem__)
        return Assessment(
            rank=rank,
            share=slowest.count(rank) / len(chosen),
            num_steps=len(chosen),
            lead_ms=statistics.median(v.leads_ms[rank] for v in chosen),
            phase=phase,
            excess_ms=excess[phase] / len(chosen),
            step_ms=statistics.median(v.step_ms for v in chosen),
        )


def assess(ranks: Sequence[Mapping[int, StepTimes]], window: int = WINDOW) -> Assessment | None:
    """Judge the last `window` steps that every rank has reported (`ranks[r][step]`) at once."""
    if len(ranks) < 2:
        return None
    judge = Judge(len(ranks), window)
    judge.add(ranks)
    return judge.assess()


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
        return (
            f"straggler: rank {self.rank} (host {printable(self.host)}, local rank {self.local_rank}) slowest in "
            f"{round(100 * self.share)} % of the last {self.num_steps} steps: "
            f"+{round(self.ms_per_step)} ms/step in {printable(self.phase)}"
        )

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
            if (
                seen is not None
                and seen.rank == self.current.rank
                and seen.share >= END_SHARE
                and seen.lead_ms >= seen.threshold_ms / 2
            ):
                self.current = _named(seen, where)  # still the one: its latest figures
                return lines
            lines.append(
                f"{self.current.message.replace('straggler:', 'straggler ended:', 1)}"
                f" (now slowest in {round(100 * seen.share) if seen and seen.rank == self.current.rank else 0} %)"
            )
            self.current = None
        if seen is not None and seen.share >= START_SHARE and seen.lead_ms >= seen.threshold_ms and seen.excess_ms > 0:
            self.current = _named(seen, where)
            lines.append(self.current.message)
        return lines


def _named(seen: Assessment, where: Sequence[tuple[str, int]]) -> Straggler:
    host, local_rank = where[seen.rank]
    return Straggler(seen.rank, host, local_rank, seen.phase, seen.excess_ms, seen.share, seen.num_steps)
