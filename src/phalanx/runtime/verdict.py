"""The watchdog's judgement: from what each rank last reported, who is stalled or dead, and the words.

A pure function of the observations (no store, no threads), so every case is unit-tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from phalanx.runtime.step_tracker import Phase

LEFT_LOOP = Phase.EXIT  # the phase of a rank that has left its script (atexit)
LEFT = (Phase.EXIT, Phase.EXIT_MID_PASS)  # ... after its data ran out, or with batches still unread
_IN_SCRIPT = (Phase.START, Phase.STEP)  # phases in which a rank runs the user's code, not phalanx's
# Phases of a training step that communicate and never take minutes as work: every rank stuck in
# one of them for longer than the collective timeout is a hang torch's timeout did not catch (a
# comm hook's future that never completes, a collective that never started). Loading data, saving,
# loading and main_process_first can legitimately take that long, and are left out; so are forward
# and the first step (step 0, or none yet), where torch.compile may compile for minutes.
_COMMUNICATING = (
    Phase.BACKWARD,
    Phase.PIPELINE,
    Phase.OPTIMIZER,
    Phase.REDUCE,
    Phase.GATHER,
    Phase.GATHER_FOR_METRICS,
    Phase.BARRIER,
    Phase.JOIN,
    Phase.AGREE,
)


START_GRACE_S = 30.0
"""Before its first step a rank imports, builds its model and opens its data, and an extension
module's import holds the interpreter for seconds (its heartbeat thread cannot run): while a rank is
there (phase 'start', no step yet), nobody is judged before this long, or the timeout when longer.
A rank that dies there ends its process, which the launcher sees at once."""


@dataclass
class PeerView:
    """What this rank has observed of one peer's record, on its own monotonic clock."""

    record: tuple[int, int, int, str] | None = None  # heartbeat, ticks, step, phase
    beat_at: float = 0.0  # when its heartbeat last changed
    moved_at: float = 0.0  # when its ticks last changed


@dataclass
class Verdict:
    culprits: list[int]
    dead: list[int]
    headline: str
    lines: list[str] = field(default_factory=list)


def judge(
    peers: list[PeerView],
    now: float,
    timeout: float,
    me: int,
    stuck_after: float | None = None,
    labels: Sequence[str] | None = None,
) -> Verdict | None:
    """A verdict when nobody moved for `timeout` and the ranks are out of step (or one is silent),
    or when all of them sat in the same communicating phase for more than `stuck_after` seconds.
    `labels`: per rank, what else names it (its pipeline stage), said next to the rank."""
    if any(v.record is None for v in peers):
        return None
    limit = timeout
    if any(v.record[2] < 0 and v.record[3] == Phase.START for v in peers):  # type: ignore[index]
        limit = max(timeout, START_GRACE_S)  # someone has not begun: an import may hold its heartbeat
    if min(now - v.moved_at for v in peers) <= limit:
        return None
    if all(v.record[3] in LEFT for v in peers):  # type: ignore[index]
        return None  # every rank has left its script: nobody waits for anyone (exit hooks may take long)
    dead = [r for r, v in enumerate(peers) if r != me and now - v.beat_at > limit]
    places = {(v.record[2], v.record[3]) for v in peers}  # type: ignore[index]
    left = [r for r, v in enumerate(peers) if v.record[3] in LEFT]  # type: ignore[index]
    name = _namer(labels)
    if not dead and not left and len(places) == 1:
        return _all_stuck(peers, now, stuck_after, name)  # same place: long work, unless it is too long
    in_script = [r for r, v in enumerate(peers) if v.record[3] in _IN_SCRIPT]  # type: ignore[index]
    if in_script:  # of the ranks busy in the script, the one(s) furthest behind
        behind = min(peers[r].record[2] for r in in_script)  # type: ignore[index]
        in_script = [r for r in in_script if peers[r].record[2] == behind]  # type: ignore[index]
    culprits = sorted(set(dead) | set(left) | set(in_script))
    if not culprits:
        lowest = min(v.record[2] for v in peers)  # type: ignore[index]
        culprits = [r for r, v in enumerate(peers) if v.record[2] == lowest]  # type: ignore[index]
    waited = min(now - v.moved_at for v in peers)
    lines = _rank_lines(peers, now, dead, culprits, name)
    c = culprits[0]
    who = (
        name(c)
        if len(culprits) == 1
        else f"ranks {culprits}" + (f" ({'; '.join(f'{r}: {labels[r]}' for r in culprits)})" if labels else "")
    )
    what = _what(who, c, peers, dead, name)
    graced = f"; {limit:g} s before every rank's first step" if limit != timeout else ""
    headline = (
        f"phalanx watchdog: {what}; no rank progressed for at least {waited:.1f} s (timeout {timeout:g} s{graced})"
    )
    return Verdict(culprits, dead, headline, lines)


def _rank_lines(
    peers: list[PeerView], now: float, dead: list[int], culprits: list[int], name: Callable[[int], str]
) -> list[str]:
    """One line per rank: its step and phase, and whether it died, stalled or waits."""
    lines = []
    for r, v in enumerate(peers):
        _, _, step, phase = v.record  # type: ignore[misc]
        if r in dead:
            note = f"  <-- died: no heartbeat for {now - v.beat_at:.1f} s"
        elif r in culprits:
            note = "  <-- stalled" if phase not in LEFT else "  <-- left its training loop"
        else:
            note = " (waiting)"
        lines.append(f"  {name(r)}: {at_step(step)}, phase {phase!r}{note}")
    return lines


def _what(who: str, c: int, peers: list[PeerView], dead: list[int], name: Callable[[int], str]) -> str:
    """What the first culprit `c` (named `who`) did, said for the headline."""
    step, phase = peers[c].record[2], peers[c].record[3]  # type: ignore[index]
    if c in dead:
        return f"{who} died (no heartbeat) at {at_step(step)}, phase {phase!r}"
    if phase == LEFT_LOOP and step >= 0 and all(v.record[2] == step for v in peers):  # type: ignore[index]
        waiting = [(name(r), v.record[3]) for r, v in enumerate(peers) if v.record[3] not in LEFT]  # type: ignore[index]
        return _parted_within_a_step(who, step, waiting)
    if phase == LEFT_LOOP:
        return (
            f"{who} left its training loop after {at_step(step)} while the others still wait: its data ran "
            "out first. HINT: prepare the DataLoader with px.prepare (equal batch counts on every rank) "
            "or wrap the loop in px.uneven_inputs(model)"
        )
    if phase == Phase.EXIT_MID_PASS:
        return (
            f"{who} exited after {at_step(step)} with batches of its prepared loader still unread (a break, "
            "return or sys.exit in the script?) while the others still wait; it has no stack left to show. "
            "HINT: end the loop at the same step on every rank (decide it with px.reduce, or wrap the loop "
            "in px.uneven_inputs(model) when the data differs per rank)"
        )
    if phase in _IN_SCRIPT:
        return f"{who} stalled at {at_step(step)} (phase {phase!r}: in the training script, between phalanx calls)"
    return f"{who} stalled at {at_step(step)}, phase {phase!r}, behind the others"


def _parted_within_a_step(who: str, step: int, waiting: list[tuple[str, str]]) -> str:
    """A rank left after the same number of prepared batches as the others: not a data length, but
    collectives made a different number of times within that step."""
    doing = ", ".join(f"{r} in phase {phase!r}" for r, phase in waiting)
    return (
        f"{who} left its training loop after {at_step(step)}, the same batch count as the others, while "
        f"{doing} still wait(s) in that step: the ranks made different numbers of collective calls in it (an "
        "optimizer whose step calls the closure a different number of times on each rank, a backward, "
        "px.reduce or gather only some ranks made). HINT: make every rank run the same collectives each "
        "step; an optimizer that reads the closure's loss (LBFGS) must read the same loss on every rank "
        "(phalanx averages it under ddp when the optimizer is prepared: see docs/optimizers.md)"
    )


def _namer(labels: Sequence[str] | None) -> Callable[[int], str]:
    return (lambda r: f"rank {r} ({labels[r]})") if labels else (lambda r: f"rank {r}")


def _all_stuck(
    peers: list[PeerView], now: float, stuck_after: float | None, name: Callable[[int], str]
) -> Verdict | None:
    step, phase = peers[0].record[2], peers[0].record[3]  # type: ignore[index]
    waited = min(now - v.moved_at for v in peers)
    if stuck_after is None or phase not in _COMMUNICATING or step < 1 or waited <= stuck_after:
        return None
    headline = (
        f"phalanx watchdog: every rank has been in phase {phase!r} at {at_step(step)} for {waited:.1f} s, "
        f"longer than a collective may take (collective timeout + watchdog timeout = {stuck_after:g} s): "
        "a communication that never completes and that torch's timeout does not cover (for example a "
        "DDP comm hook whose future is never completed). HINT: the stacks below show where each rank waits"
    )
    lines = [
        f"  {name(r)}: {at_step(v.record[2])}, phase {v.record[3]!r}  <-- stuck"  # type: ignore[index]
        for r, v in enumerate(peers)
    ]
    return Verdict(list(range(len(peers))), [], headline, lines)


def at_step(step: int) -> str:
    """'step 3' (steps count batches from prepared loaders, from 0), or before the first one."""
    return f"step {step}" if step >= 0 else "step -1 (before its first batch)"
