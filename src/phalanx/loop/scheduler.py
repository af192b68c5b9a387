"""Prepared LR schedulers: a scheduler steps only after its optimizer really stepped.

Under accumulation `optimizer.step()` is a no-op on all micro-steps but the last, and under fp16 the
gradient scaler skips steps whose gradients overflowed; a scheduler stepped on every loop iteration
would run ahead of the optimizer (and differ from a single-process run with the same global batch).
`PreparedScheduler.step()` steps the user's scheduler once per real optimizer step since its last
step, counted by a step post-hook on the optimizer that really steps.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

_PENDING = "_phalanx_pending_step"  # checkpoint key: the optimizer stepped, the scheduler not yet

# We only step after a real optimizer step, so torch's order check (which cannot see through the
# wrappers, or through zero1's new optimizer) would warn about a mistake that cannot happen.
_ORDER_WARNINGS = ("Seems like `optimizer.step()` has been overridden", "Detected call of `lr_scheduler.step()`")


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau))


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def rebind(scheduler: Any, replaced: dict[int, torch.optim.Optimizer]) -> None:
    """Point `scheduler` (and the schedulers it chains) at the optimizer that replaced the one it was
    built on (zero1 builds a ZeroRedundancyOptimizer): else it would set learning rates nobody reads."""
    for sched in [scheduler, *getattr(scheduler, "_schedulers", [])]:
        new = replaced.get(id(getattr(sched, "optimizer", None)))
        if new is not None:
            sched.optimizer = new


class PreparedScheduler:
    """The user's scheduler, stepped only when its optimizer stepped since the last scheduler step.

    Attributes and methods other than `step`, `state_dict` and `load_state_dict` are the scheduler's
    own (`get_last_lr()`, `last_epoch`, ...).
    """

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.optimizer_steps = 0  # real steps of the optimizer since this wrapper was made
        self._stepped_at = 0  # optimizer_steps when the scheduler last stepped
        _innermost(scheduler.optimizer).register_step_post_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.optimizer_steps += 1

    @property
    def pending(self) -> bool:
        """Whether the optimizer stepped since the scheduler last did."""
        return self.optimizer_steps > self._stepped_at

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """Step the scheduler if the optimizer stepped since the last call; return whether it did."""
        if not self.pending:
            return False
        self._stepped_at = self.optimizer_steps
        with warnings.catch_warnings():
            for message in _ORDER_WARNINGS:
                warnings.filterwarnings("ignore", message=re.escape(message))
            self.scheduler.step(*args, **kwargs)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {**self.scheduler.state_dict(), _PENDING: self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pending = bool(state.pop(_PENDING, False))
        self.scheduler.load_state_dict(state)
        self._stepped_at = self.optimizer_steps - (1 if pending else 0)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"
