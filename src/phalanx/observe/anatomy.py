"""Per-rank step anatomy: where each step's time goes (data, forward, backward, optimizer,
collectives, the script's own code, and phases the script names with `px.busy(name)`).

The step tracker (runtime/step_tracker.py) already marks every phase change at each phalanx call;
this observer turns the changes into durations: one `perf_counter()` and one dict update per change,
no synchronisation of any device. A step runs from one prepared-loader request to the next, so a
step's `data` is the wait for its own batch. In a loop no prepared loader feeds (data made in the
loop), a step ends when the optimizer's step returns: its phases are the model's forward and
backward and the optimizer, and the data the loop makes is in `other` (NOT_MEASURED says so). The last `KEEP` steps are kept for the exchange thread
to publish; totals since the start are kept for the exit summary.

On CUDA (`DeviceTimedAnatomy`) the host returns from a phase long before its kernels have run, so
each phase change records a CUDA event on the current stream instead, and a phase's time is the
device time between its events: the kernels queued in it, and the device's idle wait for the host
(a data wait) or for a peer (a collective's kernel). A step is read once the device has passed its
last event (`Event.query()`, never a synchronisation), usually a step or two later.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

DATA, FORWARD, BACKWARD, OPTIMIZER, PIPELINE, COLLECTIVES, OTHER = (
    "data",
    "forward",
    "backward",
    "optimizer",
    "pipeline",
    "collectives",
    "other",
)

# The step tracker's phases (runtime/step_tracker.Phase values) -> the anatomy's columns; a phase
# not listed (px.busy("tokenize"), save_state...) is a column of its own name.
CATEGORY: dict[str, str] = {
    "data": DATA,
    "forward": FORWARD,
    "backward": BACKWARD,
    "optimizer": OPTIMIZER,
    "pipeline": PIPELINE,
    "reduce": COLLECTIVES,
    "gather": COLLECTIVES,
    "gather_for_metrics": COLLECTIVES,
    "barrier": COLLECTIVES,
    "join": COLLECTIVES,
    "agree": COLLECTIVES,
    "step": OTHER,
    "start": OTHER,
}

# The order in which a step usually runs through its columns: straggler attribution adds the
# columns up in this order to find which rank fell behind first (see straggler.py). A named phase
# (px.busy) sits with `other`: the script's own code between forward and backward.
ORDER: tuple[str, ...] = (DATA, FORWARD, OTHER, BACKWARD, PIPELINE, COLLECTIVES, OPTIMIZER)

BATCHES, OPTIMIZER_STEPS = "prepared batches", "optimizer steps"  # what a step is counted by
# What a loop without a prepared loader cannot show apart (status.json's `not_measured`)
NOT_MEASURED = {
    OPTIMIZER_STEPS: "data: no prepared loader, so loading or making a batch is in 'other' "
    "(the script's own code between the model's phases)"
}

# a step has one of these; a prepared batch with none (an evaluation loop's) is no step: counted apart
TRAINING = frozenset({BACKWARD, OPTIMIZER, PIPELINE})

KEEP = 200  # recent steps kept, for the figures `phalanx top` shows
SAMPLED = 100  # steps kept for the straggler judge (every `stride`-th: see observe/exchange.py)


def rank_order(phases: "list[str] | set[str]") -> list[str]:
    """`phases` in step order: the fixed columns as ORDER, named ones with `other`, by name."""
    named = sorted(p for p in phases if p not in ORDER)
    order = [p for p in ORDER if p in phases or p == OTHER]
    at = order.index(OTHER) + 1
    return [p for p in order[:at] + named + order[at:] if p in phases]


class StepAnatomy:
    """Times the phases of this rank's steps. Called by the step tracker on the main thread;
    read (copied) by the exchange thread."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._phase = OTHER
        self._since = clock()
        self._current: dict[str, float] = {}
        self._step = -1
        self._open = False  # a step is in progress (its batch arrived, the next not yet asked for)
        self.steps: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=KEEP)
        self.sampled: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=SAMPLED)
        self.stride = 1  # `sampled` keeps the steps whose number it divides (set by the exchange)
        self.totals: dict[str, float] = {}  # seconds per column over every finished step
        self.num_steps = 0
        self.eval_batches = 0  # prepared batches with no backward or optimizer step (evaluation)
        self.on_step: list[Callable[[int], None]] = []  # after each finished step, on the main thread
        self.counts = BATCHES  # what ends a step: a prepared loader's request, or an optimizer step

    def switch(self, phase: str) -> None:
        """The rank enters `phase` (a tracker phase name) now."""
        now = self._clock()
        current = self._current
        current[self._phase] = current.get(self._phase, 0.0) + now - self._since
        self._since = now
        self._phase = CATEGORY.get(phase, phase)

    def step_boundary(self, entering: str = DATA) -> None:
        """A prepared loader asks for the next batch (`entering` data): the step in progress ends here."""
        self.switch(entering)
        if self._open:
            self._open = False
            self._finish(self._step, self._current)
        self._current = {}

    def _finish(self, step: int, done: dict[str, float]) -> None:
        if TRAINING.isdisjoint(done):  # an evaluation batch: the exit table counted 126 steps for 100
            self.eval_batches += 1
            return
        self.steps.append((step, done))
        if step % self.stride == 0:
            self.sampled.append((step, done))
        for name, seconds in done.items():
            self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.num_steps += 1
        for hook in self.on_step:
            hook(step)

    def next_step(self, step: int) -> None:
        """The batch of `step` arrived (its data wait is counted in it)."""
        self._step = step
        self._open = True

    def optimizer_step(self) -> None:
        """An optimizer step returned in a loop no prepared loader feeds: the step ends here, and is
        numbered as a loader's would be (from 0: after N steps, step N - 1)."""
        self.counts = OPTIMIZER_STEPS
        self.next_step(self._step + 1)
        self.step_boundary(OTHER)

    @property
    def step(self) -> int:
        return self._step


class DeviceTimedAnatomy(StepAnatomy):
    """Phase times from device events (CUDA): see the module's docstring."""

    def __init__(self, new_event: Callable[[], Any]):
        super().__init__()
        self._new_event = new_event  # e.g. lambda: torch.cuda.Event(enable_timing=True)
        self._marks: list[tuple[str, Any]] = [(OTHER, self._record())]  # (column entered, its event)
        self._pending: collections.deque[tuple[int, list[tuple[str, Any]]]] = collections.deque()

    def _record(self) -> Any:
        event = self._new_event()
        event.record()
        return event

    def switch(self, phase: str) -> None:
        self._marks.append((CATEGORY.get(phase, phase), self._record()))

    def step_boundary(self, entering: str = DATA) -> None:
        self.switch(entering)
        if self._open:
            self._open = False
            self._pending.append((self._step, self._marks))
        self._marks = [self._marks[-1]]  # the next step starts with this data wait
        while self._pending and self._pending[0][1][-1][1].query():
            step, marks = self._pending.popleft()
            done: dict[str, float] = {}
            for (name, start), (_, end) in zip(marks, marks[1:]):
                done[name] = done.get(name, 0.0) + start.elapsed_time(end) / 1000
            self._finish(step, done)
