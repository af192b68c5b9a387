"""Where this rank is in its training loop (step, phase), for the watchdog to publish.

Written by the main thread at every phalanx call (plain attribute stores, ~100 ns), read by the
watchdog thread. `ticks` changes at every transition, so "no tick for T seconds" means "stuck".
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

# Phases a rank is in while phalanx itself is running: a rank in one of these may be waiting for
# its peers. "step" means "in the training script, between phalanx calls".
STEP = "step"


class Progress:
    """The current step (batches taken from prepared loaders, from 0) and phase of this rank."""

    __slots__ = ("step", "phase", "ticks", "busy")

    def __init__(self) -> None:
        self.step = -1  # no batch yet
        self.phase = "start"
        self.ticks = 0
        self.busy = 0  # > 0 inside `busy()`: long work the others are meant to wait for

    def next_step(self) -> None:
        self.step += 1
        self.phase = STEP
        self.ticks += 1

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.ticks += 1

    @contextlib.contextmanager
    def busy_with(self, phase: str) -> Iterator[None]:
        """Long rank-local work the other ranks wait for on purpose (saving a checkpoint on rank 0,
        building a cache first): the watchdog counts this rank as progressing while it lasts."""
        self.busy += 1
        try:
            with self.during(phase):
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


def watch_module(progress: Progress, module: "torch.nn.Module") -> None:
    """Mark the model's forward (where DDP may broadcast buffers, FSDP all-gathers) as a phase."""
    module.register_forward_pre_hook(lambda *_: progress.enter("forward"))
    module.register_forward_hook(lambda *_: progress.enter(STEP))


def watch_optimizer(progress: Progress, optimizer: "torch.optim.Optimizer") -> None:
    """Mark optimizer.step (collectives under zero1..3) as a phase."""
    optimizer.register_step_pre_hook(lambda *_: progress.enter("optimizer"))
    optimizer.register_step_post_hook(lambda *_: progress.enter(STEP))
