"""Batches of no rows for a rank out of data while its peers still train, under FSDP2.

torch's Join lets a DDP rank that ran out shadow its peers' gradient all-reduces from outside the
loop. An FSDP2 model is not Joinable: its forward and backward all-gather the parameters, its
backward reduce-scatters the gradients, and each rank steps its own shard of every parameter, so a
rank out of data must keep running the loop's body. `uneven.iter(...)` hands it its last batch cut
to no rows: its forward and backward meet the peers' collectives and contribute zero gradients, the
reduce-scatter divides by the ranks that started (what DDP does under Join), and its optimizer
steps its shard with the others' gradients. The loop counts no item for it (`len(x) == 0`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from phalanx.data.batch_records import BatchInfo
from phalanx.data.equalize import agree_step, lend_batch
from phalanx.data.loader import _batch_len
from phalanx.runtime.step_tracker import Phase, StepTracker

_END = object()


def no_rows(batch: Any) -> Any:
    """`batch` with its tensors (and lists of Python objects) cut to no rows along the batch dimension."""
    size = _batch_len(batch)
    if not size:
        raise ValueError(
            f"phalanx: px.uneven_inputs under FSDP2 hands a rank that ran out of data its last batch cut to "
            f"no rows, but a batch of {type(batch).__name__} has no tensor with a batch dimension to cut. "
            "HINT: yield tensors (or tuples/dicts of them) from the iterable given to uneven.iter(...), or give "
            "every rank as many batches"
        )
    return BatchInfo(size=size, num_real=0).without_padding(batch)


class Shadowing:
    """Whether this rank is out of data and shadowing its peers (read by px.reduce / px.gather)."""

    def __init__(self) -> None:
        self.idle = False

    def iter(self, iterable: Iterable[Any], progress: StepTracker | None) -> Iterator[Any]:
        """`iterable`'s items, then batches of no rows until every rank is out of data."""
        it, last = iter(iterable), None
        try:
            while True:
                if progress is not None:
                    progress.enter(Phase.AGREE)
                item = _END if self.idle else next(it, _END)
                decision = agree_step(item is not _END, can_pad=last is not None, drop=False)
                if not decision.proceed:
                    return
                if decision.donor is not None:  # a rank that never had a batch copies the shape of one
                    lent = lend_batch(None if item is _END else item, decision.donor)
                    last = lent if last is None else last
                if item is _END:
                    self.idle = True
                    item = no_rows(last)
                else:
                    last = item
                yield item
        finally:
            self.idle = False
