"""Every key phalanx writes into the rendezvous store (no torch here).

Each rank's watchdog publishes its progress record, and on an uncaught exception the moment it
failed; the launcher's agent reads both when a rank fails, to name the step in its report and to
order failures that torch's whole-second timestamps cannot tell apart. When the watchdog finds a
stall, the ranks agree on a verdict and exchange their stacks for one report. The watchdog works
under `watchdog_prefix(restart)` and uses the short names; the launcher reads the full keys. One
place for the layout, so writer and reader cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass


def watchdog_prefix(restart: int | str) -> str:
    """The watchdog's key prefix for one restart attempt (records of other attempts never mix)."""
    return f"phalanx/watchdog/{restart}"


# Names under the watchdog's prefix.
VERDICT = "verdict"  # the first rank to judge a stall writes what every rank must do
REPORT = "report"  # the stall report with every rank's stack, written once
REPORTED = "reported"  # set when REPORT is complete


def record_name(rank: int) -> str:
    """Rank `rank`'s progress record: `beat|ticks|step|phase`."""
    return f"r{rank}"


def failed_name(rank: int) -> str:
    """Rank `rank`'s failure note: `unix time|step`, written when it raised."""
    return f"failed{rank}"


def stack_name(rank: int) -> str:
    """Rank `rank`'s Python stack, for a stall report."""
    return f"stack{rank}"


def record_key(restart: int | str, rank: int) -> str:
    """Full key of rank `rank`'s progress record, as the launcher reads it."""
    return f"{watchdog_prefix(restart)}/{record_name(rank)}"


def failed_key(restart: int | str, rank: int) -> str:
    """Full key of rank `rank`'s failure note, as the launcher reads it."""
    return f"{watchdog_prefix(restart)}/{failed_name(rank)}"


def preempt_prefix(restart: int | str, generation: int = 0) -> str:
    """The preemption agreement's key prefix for one restart attempt and, within it, one `Phalanx()`
    of each rank's process (`generation` counts them: a notebook builds a second one after the first
    stopped, on the same store, and must not read the first one's agreement; see preemption/worker.py)."""
    return f"phalanx/preempt/{restart}/{generation}"


PREEMPT_REQUESTED = "requested"  # `SIGNAL|reason`, written by the first rank that heard of it
PREEMPT_COUNT = "count"  # how many ranks have posted their step


def preempt_step_key(rank: int) -> str:
    """Under `preempt_prefix`: the step at which rank `rank` first knew of the preemption."""
    return f"at{rank}"


@dataclass(frozen=True)
class RankProgress:
    """What the launcher learnt about one rank from the store."""

    step: int | None = None  # batches taken from prepared loaders, from 0; -1 before the first
    phase: str | None = None
    failed_at: float | None = None  # unix time of its uncaught exception (sub-second)


def parse(record: bytes | None, failed: bytes | None) -> RankProgress:
    """Decode a record and a failure note (either may be missing or garbled: then None fields)."""
    step = phase = failed_at = None
    try:
        if record:
            _, _, raw_step, phase = record.decode().split("|", 3)
            step = int(raw_step)
        if failed:
            raw_time, raw_step = failed.decode().split("|", 1)
            failed_at, step = float(raw_time), int(raw_step)
    except ValueError:
        pass
    return RankProgress(step, phase, failed_at)


def observe_key(restart: int | str, rank: int) -> str:
    """Rank `rank`'s step-anatomy summary (JSON) for one restart attempt (see observe/exchange.py)."""
    return f"phalanx/observe/{restart}/r{rank}"


def arrival_key(what: str, call: int, rank: int) -> str:
    """Rank `rank` reached its `call`-th call of `what` (e.g. save_pretrained), which every rank
    must make: the ranks check they all did before a collective that would wait for the absent."""
    return f"phalanx/arrival/{what}/{call}/r{rank}"
