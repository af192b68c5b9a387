"""Where this rank is in its training loop (step, phase), for the watchdog to publish.

Written by the main thread at every phalanx call (plain attribute stores, ~100 ns), read by the
watchdog thread. `ticks` changes at every transition, so "no tick for T seconds" means "stuck".
"""

from __future__ import annotations

import contextlib
import enum
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch


class Phase(str, enum.Enum):
    """Where a rank is. STEP and START mean "in the training script, between phalanx calls"; in the
    others phalanx itself runs and the rank may be waiting for its peers. Published to the store as
    its value; work named with `px.busy(name)` publishes that name instead."""

    START = "start"
    STEP = "step"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    PIPELINE = "pipeline"  # a pipeline step or forward: this rank's stages, exchanging with their neighbours
    OPTIMIZER = "optimizer"
    REDUCE = "reduce"
    GATHER = "gather"
    GATHER_FOR_METRICS = "gather_for_metrics"
    BARRIER = "barrier"
    JOIN = "join"
    AGREE = "agree"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    LOAD_MODEL = "load_model"
    MAIN_PROCESS_FIRST = "main_process_first"
    FAILED = "failed"
    EXIT = "exit"
    EXIT_MID_PASS = "exit mid-pass"  # left with batches of a prepared loader's pass still unread

    __str__ = str.__str__
    __format__ = str.__format__


STEP = Phase.STEP


class StepTracker:
    """The current step (batches taken from prepared loaders, from 0) and phase of this rank."""

    __slots__ = (
        "step",
        "phase",
        "ticks",
        "busy",
        "on_batch_request",
        "batch_request_hooks",
        "mid_pass",
        "anatomy",
        "fed",
        "on_busy",
    )

    def __init__(self) -> None:
        self.step = -1  # no batch yet
        self.phase: str = Phase.START
        self.ticks = 0
        self.busy = 0  # > 0 inside `busy()`: long work the others are meant to wait for
        self.on_batch_request: Callable[[], None] | None = None  # preemption's step-boundary check
        self.anatomy: Any = None  # observe.anatomy.StepAnatomy: times the phases (None: off)
        self.batch_request_hooks: list[Callable[[], None]] = []  # other work due at a step boundary
        self.mid_pass = False  # a prepared loader's pass has begun and not run out (an exit now is early)
        self.fed = False  # a prepared loader has been read: its requests, not optimizer steps, end steps
        self.on_busy: Callable[[], None] | None = None  # the watchdog's publish-now (busy_with)

    def before_batch(self) -> None:
        """A prepared loader is about to read its next batch: the script finished the step before."""
        self.fed = True
        for hook in self.batch_request_hooks:  # a deferred save first: a preemption stop may follow
            hook()
        hook = self.on_batch_request
        if hook is not None:
            hook()
        if self.anatomy is not None:
            self.anatomy.step_boundary()

    def next_step(self) -> None:
        self.step += 1
        self.phase = STEP
        self.ticks += 1
        if self.anatomy is not None:
            self.anatomy.next_step(self.step)
            self.anatomy.switch(STEP)

    def optimizer_stepped(self) -> None:
        """optimizer.step() returned: back in the script; in a loop no prepared loader feeds, the
        anatomy's step ends here (`step` itself keeps counting prepared batches: the watchdog and
        preemption read it so)."""
        self.enter(STEP)
        if self.anatomy is not None and not self.fed:
            self.anatomy.optimizer_step()

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.ticks += 1
        if self.anatomy is not None:
            self.anatomy.switch(phase)

    @contextlib.contextmanager
    def busy_with(self, phase: str) -> Iterator[None]:
        """Long rank-local work the other ranks wait for on purpose (saving a checkpoint on rank 0,
        building a cache first): the watchdog counts this rank as progressing while it lasts.

        The phase is published at once (`on_busy`), not at the next heartbeat: a rank killed a moment
        into its save is named by its peers in the save's phase, not in the one before it."""
        self.busy += 1
        try:
            with self.during(phase):
                if self.on_busy is not None:
                    self.on_busy()
                yield
        finally:
            self.busy -= 1

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Mark `phase` for the block, then return to the phase before it."""
        previous = self.phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(previous)


def watch_module(progress: StepTracker, module: "torch.nn.Module") -> None:
    """Mark the model's forward (where DDP may broadcast buffers, FSDP all-gathers) as a phase, and
    the backward through it, also when the script calls `loss.backward()` itself."""
    module.register_forward_pre_hook(lambda *_: progress.enter(Phase.FORWARD))

    def after_forward(_module: Any, _args: Any, output: Any) -> None:
        progress.enter(STEP)
        for tensor in _grad_tensors(output):
            tensor.register_hook(lambda _grad: _backward_begins(progress))

    module.register_forward_hook(after_forward)


def _grad_tensors(output: Any, limit: int = 4) -> list["torch.Tensor"]:
    """The first few tensors of a forward's output (a tensor, tuple, dict, ModelOutput) that the
    backward will pass through: a hook on them says the backward has reached the model."""
    import torch

    found: list[torch.Tensor] = []
    todo = [output]
    while todo and len(found) < limit:
        item = todo.pop(0)
        if isinstance(item, torch.Tensor):
            if item.requires_grad and item.grad_fn is not None:
                found.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return found


def _backward_begins(progress: StepTracker) -> None:
    """A gradient reached the model's output: the backward phase, until autograd's pass ends (its
    engine's callback), unless phalanx's own backward already marks it."""
    if progress.phase == Phase.BACKWARD:
        return
    from torch.autograd import Variable

    previous = progress.phase
    progress.enter(Phase.BACKWARD)
    Variable._execution_engine.queue_callback(lambda: progress.enter(previous))


def watch_optimizer(progress: StepTracker, optimizer: "torch.optim.Optimizer") -> None:
    """Mark optimizer.step (collectives under zero1..3) as a phase."""
    optimizer.register_step_pre_hook(lambda *_: progress.enter(Phase.OPTIMIZER))
    optimizer.register_step_post_hook(lambda *_: progress.optimizer_stepped())
