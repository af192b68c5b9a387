"""Talking across ranks: `px.print`, `px.reduce`, `px.gather`, `px.gather_for_metrics`,
`px.wait_for_everyone` and `px.main_process_first`, as functions of the `Phalanx` they are bound to
(facade.py assigns them as its methods). Each marks its phase for the watchdog and talks over the
data-parallel group only: under tensor, pipeline or context parallel, the ranks that read the same
data hold the same values."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from phalanx.data.loader import PreparedLoader
from phalanx.data.uneven import current_join
from phalanx.runtime import collectives
from phalanx.runtime.step_tracker import Phase


def print_main(px: Any, *args: Any, **kwargs: Any) -> None:
    """`print` on the main process only."""
    if px.is_main_process:
        print(*args, **kwargs)


def reduce(px: Any, data: Any, reduction: str = "mean") -> Any:
    """`data` (a tensor, a number, or a list/dict of them) reduced over the data-parallel ranks
    (inside `px.uneven_inputs` under torch's Join: over the ranks still stepping)."""
    with px._step_progress.during(Phase.REDUCE):
        joined = current_join()
        if joined is not None:
            return joined.reduce(data, reduction, px.device)
        return collectives.reduce(data, reduction, debug=px.debug, group=px._dp_group, device=px.device)


def gather(px: Any, data: Any) -> Any:
    """`data` (tensors, nested) concatenated over the data-parallel ranks, in rank order (inside
    `px.uneven_inputs` under torch's Join: the ranks still stepping)."""
    with px._step_progress.during(Phase.GATHER):
        joined = current_join()
        if joined is not None:
            return joined.gather(data, px.device)
        return collectives.gather(data, debug=px.debug, group=px._dp_group, device=px.device)


def gather_for_metrics(px: Any, data: Any, loader: PreparedLoader | None = None) -> Any:
    """Gather like `gather`, without the repeats the sampler added to even out the ranks.

    Inside a loop over a prepared loader, this rank's padding samples are cut from the
    current batch before gathering, so an eval over N items yields exactly N. Python lists
    (e.g. predicted strings) are gathered as objects and flattened. The batch is the last one of
    the innermost loop in progress (an eval inside training: the eval's, then the training's
    again); with loaders read side by side (`zip`), name the one `data` came from: `loader=`.
    """
    mine = (px._batch_records.current() if loader is None else loader.batch_info).without_padding(data)
    with px._step_progress.during(Phase.GATHER_FOR_METRICS):
        if isinstance(data, list) and not any(isinstance(x, torch.Tensor) for x in data):
            return [x for part in collectives.gather_object(mine, debug=px.debug, group=px._dp_group) for x in part]
        return collectives.gather(mine, debug=px.debug, group=px._dp_group, device=px.device)


def wait_for_everyone(px: Any) -> None:
    """Barrier across all ranks (no-op in a world of one)."""
    with px._step_progress.during(Phase.BARRIER):
        collectives.barrier(debug=px.debug)


@contextlib.contextmanager
def main_process_first(px: Any) -> Iterator[None]:
    """Let the main process run the block first (e.g. to download or cache a dataset)."""
    if not px.is_main_process:
        wait_for_everyone(px)
        yield
        return
    with px.busy(Phase.MAIN_PROCESS_FIRST):  # the others wait on purpose: not a stall
        yield
    wait_for_everyone(px)
