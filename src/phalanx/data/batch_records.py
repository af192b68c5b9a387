"""What each prepared loader knows of the batch it yielded last, and which loader a metric belongs to.

Every prepared loader keeps its own record, so loaders used together stay independent: an eval loop
inside the training loop, or `zip` of two loaders. `gather_for_metrics` reads the record of the
innermost pass in progress (the loader that yielded last among those whose pass is not over), or the
one of the loader it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.runtime.collectives import map_tensors


@dataclass(eq=False)
class BatchInfo:
    """What the loader knows of the batch it yielded last; read by gather_for_metrics."""

    size: int | None = None  # samples in the batch on this rank
    num_real: int | None = None  # of those, how many are not padding repeats
    left: int | None = None  # batches left in the pass, this one included (None: unknown); ends
    # gradient accumulation cycles with the epoch
    step_reals: tuple[int, ...] | None = None  # every rank's real samples this step, when gathered

    def clear(self) -> None:
        self.size = self.num_real = self.left = None
        self.step_reals = None

    def loss_weight(self) -> float | None:
        """What this rank's mean loss is multiplied by so that the ranks' average is the mean over the
        step's real samples, as one process takes it: ranks x real / Σ real (0 for a padding batch);
        None when every rank's batch is whole and alike (nothing to weigh)."""
        reals, real = self.step_reals, self.num_real
        if not reals or real is None or len(set(reals)) == 1 and real == self.size:
            return None
        total = sum(reals)
        return len(reals) * real / total if total else 0.0

    def weigh(self, loss: Any, num_items: Any) -> tuple[Any, Any]:
        """(loss, num_items) of a backward on this batch: a mean loss weighed by `loss_weight`; a
        summed one (`num_items`) already counts real items only, but a padding batch counts none."""
        weight = self.loss_weight()
        if weight is None:
            return loss, num_items
        if weight == 0:  # a mean over no rows (a batch all padding, cut) is NaN: it weighs 0 all the same
            return loss.nan_to_num(0.0) * 0, None if num_items is None else 0
        return (loss * weight, None) if num_items is None else (loss, num_items)

    def without_padding(self, data: Any) -> Any:
        """`data` computed from this batch, less this rank's padding repeats: tensors (nested in
        containers) whose first dimension is the batch's size cut to its real samples, and a list
        of that many Python objects (predicted strings) likewise; anything else as it is."""
        size, real = self.size, self.num_real
        if size is None or real is None or real >= size:
            return data
        if isinstance(data, list) and len(data) == size and not any(hasattr(x, "shape") for x in data):
            return data[:real]
        return map_tensors(lambda t: t[:real] if t.dim() > 0 and t.shape[0] == size else t, data)


def real_rows(batch: Any, size: int | None, real: int | None, empty: bool = False) -> tuple[Any, int | None]:
    """(`batch` less its padding repeats, its size): a batch partly padded (the short last one of a
    map-style epoch: the repeats follow the real samples) is cut to its real rows, so no repeat is
    trained on. A batch all padding is cut to no rows when `empty` (the rank still takes its step:
    zero gradients, its collectives met; the loop counts no item, as one process has none there),
    else (pipeline stages cannot run empty microbatches) kept whole; it weighs 0 either way."""
    if size is None or real is None or real >= size or real == 0 and not empty:
        return batch, size
    return BatchInfo(size=size, num_real=real).without_padding(batch), real


class BatchRecords:
    """The records of the loaders whose pass is in progress, the one that yielded last on top."""

    def __init__(self) -> None:
        self._open: list[BatchInfo] = []
        self._none = BatchInfo()  # no pass in progress: nothing known, nothing trimmed

    def yielded(self, info: BatchInfo) -> None:
        """`info`'s loader just yielded a batch: its record is the current one."""
        if self._open and self._open[-1] is info:
            return
        self.ended(info)
        self._open.append(info)

    def ended(self, info: BatchInfo) -> None:
        """`info`'s loader ended (or left) its pass."""
        self._open = [other for other in self._open if other is not info]

    def current(self) -> BatchInfo:
        return self._open[-1] if self._open else self._none
