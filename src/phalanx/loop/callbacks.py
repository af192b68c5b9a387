"""The loop's one callback list: what runs beside the training loop (`phalanx parity`'s recorder,
the throughput meter behind the dashboard's and the trackers' figures) subscribes here, and the
facade calls the list at fixed points instead of testing for each feature (Fabric's callbacks).

A callback is any object with some of these methods; the list calls the ones it has, in order:
- `on_model(model)`: px.prepare(model), with the user's module, prepared;
- `loader_scale(split_batches) -> int`: how many of the script's batches one step of a prepared
  loader takes (1: as written; `phalanx parity`'s one-process run takes the ranks' global batch);
- `on_loader(batch_size)`: a prepared loader, with the batch each of its steps gives this rank;
- `on_backward(loss, num_items)`: px.backward's loss, before the backward pass;
- `before_step(step, params)`: once per optimizer step, before clipping and stepping.
"""

from __future__ import annotations

from typing import Any


class LoopCallbacks:
    """The callbacks of one `Phalanx`, called in the order they were added."""

    def __init__(self, *callbacks: Any):
        self.callbacks = [c for c in callbacks if c is not None]

    def notify(self, hook: str, *args: Any) -> None:
        """Call `hook(*args)` on every callback that has it."""
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def loader_scale(self, split_batches: bool) -> int:
        """The product of the callbacks' `loader_scale` (1 when none asks for one)."""
        scale = 1
        for callback in self.callbacks:
            if hasattr(callback, "loader_scale"):
                scale *= callback.loader_scale(split_batches)
        return scale
