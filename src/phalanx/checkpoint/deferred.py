"""`px.save_state()` called in the middle of a gradient-accumulation cycle: saved at the cycle's end.

A checkpoint holds the model, the optimizer and the data position, not the gradients a cycle has
accumulated so far; a resume from the middle of a cycle would restart it without them (losses after
the resume differed by up to 50 %). So, as preemption does, the save waits for the cycle's optimizer
step and is written at the next step boundary: when the script asks a prepared loader for its next
batch (the position is then exactly a step's, the scheduler has stepped). The call returns the path
the checkpoint will have, and warns once. (A loop that reads no prepared loader has no such boundary:
its next save_state at a cycle's end writes instead.)
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

from phalanx.checkpoint import atomic


class DeferredSave:
    """A save asked for mid-cycle, written at the first step boundary after the cycle's step."""

    def __init__(self, checkpointer: Any, cycle_idle: Callable[[], bool], save: Callable[[Any, Any], Any]):
        self.checkpointer = checkpointer
        self.cycle_idle = cycle_idle
        self.save = save  # (path, async_save) -> the saved path
        self.pending: tuple[Any, Any] | None = None
        self._asked_at: int | None = None  # global_step when it was asked for
        self._warned = False

    def request(self, path: str | os.PathLike | None, async_save: bool | None, micro_step: int, cycle_len: int) -> str:
        """Remember the save; the path it will be written to (the step after this cycle's)."""
        step = self.checkpointer.global_step
        if self.pending is None:
            self.pending, self._asked_at = (path, async_save), step
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"phalanx: save_state() at micro-step {micro_step} of an accumulation cycle of {cycle_len}: a "
                "checkpoint holds no accumulated gradients, so it is written after this cycle's optimizer step, "
                f"at the next step boundary (step {step + 1}). HINT: save when px.sync_gradients is True",
                stacklevel=3,
            )
        if path is not None:
            return str(path)
        directory = self.checkpointer.directory
        return str(Path(directory) / atomic.step_dir_name(step + 1)) if directory is not None else ""

    def at_boundary(self, *_: Any) -> None:
        """A step boundary: write the pending save once the cycle has stepped."""
        if self.pending is None or not self.cycle_idle() or self.checkpointer.global_step == self._asked_at:
            return
        (path, async_save), self.pending = self.pending, None
        self.save(path, async_save)
