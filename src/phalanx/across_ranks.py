"""Talking across ranks: `px.print`, `px.reduce`, `px.gather`, `px.gather_for_metrics`,
`px.wait_for_everyone` and `px.main_process_first`, as functions of a `RankTalk`: the narrow door the
`Phalanx` opens to them (facade.py builds it once and delegates its methods here). Each marks its phase for the watchdog and talks over the
data-parallel group only: under tensor, pipeline or context parallel, the ranks that read the same
data hold the same values."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from phalanx.data.batch_records import BatchRecords
from phalanx.data.loader import PreparedLoader
from phalanx.data.uneven import current_join
from phalanx.runtime import collectives
from phalanx.runtime.step_tracker import Phase, StepTracker


@dataclass(frozen=True)
class RankTalk:
    """What talking across ranks needs of the `Phalanx` it serves, and nothing more."""

    progress: StepTracker  # each call marks its phase for the watchdog
    records: BatchRecords  # the prepared loaders' last batches: gather_for_metrics drops their padding
    device: torch.device
    is_main_process: bool
    group: Callable[[], Any]  # the data-parallel group (None: every rank), asked at each call: auto decides at prepare
    debug: Callable[[], bool]  # px.debug, which a script may turn on later


def print_main(talk: RankTalk, *args: Any, **kwargs: Any) -> None:
    """`print` on the main process only."""
    if talk.is_main_process:
        print(*args, **kwargs)


def reduce(talk: RankTalk, data: Any, reduction: str = "mean") -> Any:
    """`data` (a tensor, a number, or a list/dict of them) reduced over the data-parallel ranks
    (inside `px.uneven_inputs` under torch's Join: over the ranks still stepping)."""
    with talk.progress.during(Phase.REDUCE):
        joined = current_join()
        if joined is not None:
            return joined.reduce(data, reduction, talk.device)
        return collectives.reduce(data, reduction, debug=talk.debug(), group=talk.group(), device=talk.device)


def gather(talk: RankTalk, data: Any) -> Any:
    """`data` (tensors, nested) concatenated over the data-parallel ranks, in rank order (inside
    `px.uneven_inputs` under torch's Join: the ranks still stepping)."""
    with talk.progress.during(Phase.GATHER):
        joined = current_join()
        if joined is not None:
            return joined.gather(data, talk.device)
        return collectives.gather(data, debug=talk.debug(), group=talk.group(), device=talk.device)


def gather_for_metrics(talk: RankTalk, data: Any, loader: PreparedLoader | None = None) -> Any:
    """Gather like `gather`, without the repeats the sampler added to even out the ranks.

    Inside a loop over a prepared loader, this rank's padding samples are cut from the
    current batch before gathering, so an eval over N items yields exactly N. Python lists
    (e.g. predicted strings) are gathered as objects and flattened. The batch is the last one of
    the innermost loop in progress (an eval inside training: the eval's, then the training's
    again); with loaders read side by side (`zip`), name the one `data` came from: `loader=`.
    """
    mine = (talk.records.current() if loader is None else loader.batch_info).without_padding(data)
    with talk.progress.during(Phase.GATHER_FOR_METRICS):
        if isinstance(data, list) and not any(isinstance(x, torch.Tensor) for x in data):
            return [x for part in collectives.gather_object(mine, debug=talk.debug(), group=talk.group()) for x in part]
        return collectives.gather(mine, debug=talk.debug(), group=talk.group(), device=talk.device)


def wait_for_everyone(talk: RankTalk) -> None:
    """Barrier across all ranks (no-op in a world of one)."""
    with talk.progress.during(Phase.BARRIER):
        collectives.barrier(debug=talk.debug())


@contextlib.contextmanager
def main_process_first(talk: RankTalk) -> Iterator[None]:
    """Let the main process run the block first (e.g. to download or cache a dataset)."""
    if not talk.is_main_process:
        wait_for_everyone(talk)
        yield
        return
    with talk.progress.busy_with(Phase.MAIN_PROCESS_FIRST):  # the others wait on purpose: not a stall
        yield
    wait_for_everyone(talk)
