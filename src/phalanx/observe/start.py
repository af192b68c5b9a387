"""Wires the step anatomy and the exchange into one `Phalanx()` (worker side)."""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any

from phalanx.logging.rank_log import get_logger
from phalanx.observe import records
from phalanx.observe.anatomy import DeviceTimedAnatomy, StepAnatomy
from phalanx.observe.exchange import Exchange
from phalanx.runtime.process_group import ignoring_sigint


def start(
    progress: Any,
    watchdog: Any,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    attempt: str,
    run_dir: str,
    device: Any,
    metrics: Any,
    job_step: Any = lambda: None,
) -> Exchange:
    """Time `progress`'s phases (a StepTracker); publish through `watchdog`'s heartbeat (None in a
    world of one: rank 0 then writes its own status at step boundaries)."""
    anatomy = StepAnatomy() if getattr(device, "type", None) != "cuda" else DeviceTimedAnatomy(_cuda_event)
    logger = get_logger("observe")
    exchange = Exchange(
        anatomy,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        attempt=attempt,
        run_dir=run_dir,
        phase=lambda: progress.phase,
        device=device,
        warn=logger.warning,
        last_metrics=lambda: metrics.last_row,
        job_step=job_step,
    )
    progress.anatomy = anatomy
    if watchdog is not None:
        watchdog.add_listener(exchange.tick)
        if rank == 0:  # a straggler named or let go reaches the trackers from the main thread
            anatomy.on_step.append(lambda step: _send_events(exchange, metrics))
        watchdog.on_report.append(lambda report: _keep_verdict(run_dir, attempt, report))
    elif world_size == 1:
        anatomy.on_step.append(exchange.tick_alone)
    # A later Phalanx() in this process takes over (as the watchdog does): one exit hook at a time.
    atexit.unregister(_at_exit)
    atexit.unregister(_publish_last)
    if rank == 0 and (watchdog is not None or world_size == 1):
        atexit.register(_at_exit, exchange, logger, watchdog)
    elif watchdog is not None:  # before the watchdog leaves (atexit runs last registered first)
        atexit.register(_publish_last, exchange, watchdog)
    return exchange


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


def _send_events(exchange: Exchange, metrics: Any) -> None:
    while exchange.events:
        step, values = exchange.events.pop(0)
        metrics.record(step, values)


def _publish_last(exchange: Exchange, watchdog: Any) -> None:
    """This rank's last summary, for rank 0's exit table."""
    try:
        with ignoring_sigint():
            exchange.publish(watchdog.store.underlying_store, final=True)
    except Exception as error:  # noqa: BLE001 - rank 0 may be gone already; the table then misses this rank
        print(f"phalanx (rank {exchange.rank}): could not publish the last step anatomy: {error}", file=sys.stderr)


def _collect_last(exchange: Exchange, store: Any, wait_s: float = 3.0) -> None:
    """Rank 0 at exit: every rank's last summary (they publish it on their way out), for a while."""
    try:
        exchange.publish(store, final=True)
        deadline = time.monotonic() + wait_s
        while not exchange.collect(store) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception as error:  # noqa: BLE001 - a peer's failure took the store down: show what is known
        print(f"phalanx: the exit's step anatomy may miss ranks: {error}", file=sys.stderr)


def _keep_verdict(run_dir: str, attempt: str, report: str) -> None:
    try:
        records.write_text(run_dir, records.verdict_name(attempt), report.split("\nPython stack")[0])
    except OSError as error:  # the report itself still goes out: this is only its copy for the page
        print(f"phalanx: could not keep the watchdog's report in {run_dir}: {error}", file=sys.stderr)


def _at_exit(exchange: Exchange, logger: Any, watchdog: Any) -> None:
    with ignoring_sigint():  # Ctrl-C's second delivery must not cut the exit short (see there)
        _summarise_at_exit(exchange, logger, watchdog)


def _summarise_at_exit(exchange: Exchange, logger: Any, watchdog: Any) -> None:
    if watchdog is None:  # a world of one: its status only (no peers to compare in a table)
        exchange.finish()
        return
    watchdog.mark_leaving()  # waiting for the others' last summaries below is no stall
    _collect_last(exchange, watchdog.store.underlying_store)
    table = exchange.phase_table()
    if table:
        logger.info("%s", table)
    if exchange.watch.current is not None:
        logger.warning("%s (still at exit)", exchange.watch.current.message)
    exchange.finish()
