"""Preemption: on SIGTERM/SIGUSR1 every rank finishes its step, the ranks agree on one step, a
checkpoint of it is written, and the job exits with 128 + the signal number.

Where a step ends. A script's step is complete when it asks a prepared loader for its next batch
(the optimizer, the scheduler and the script's own bookkeeping have run; the batch has not been
read, so the loader position and every RNG are exactly those of a step boundary), outside an
unfinished accumulation cycle. A script whose loop takes no batch from a prepared loader stops
right after `optimizer.step()` instead (a prepared scheduler's pending step is saved with it).

Agreeing without a collective per step. Signals reach the ranks at different moments (or reach
one rank only), so each rank, at its first step boundary after it knew, posts its step `s_r` to
the store and keeps training; once all ranks have posted, the stop step is S = max(s_r) + 1.
Every rank reaches S: no rank can complete a step without the others (the gradient reduction
needs them all), so a rank that has not yet posted is at most one step behind any rank's post,
and every rank reads the posts at each boundary after its own post, before passing S (the
argument is in docs/preemption.md). Ranks learn of a signal they did not receive themselves from
the store key the first rank writes, read by the watchdog's thread once a second beside its
heartbeat (with the watchdog off: at each boundary). Before any signal the cost per step is one
attribute test at each boundary; no collective, no store call.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from phalanx import store_keys
from phalanx import preemption_report as report
from phalanx.checkpoint import atomic
from phalanx.checkpoint.save_attempt import CheckpointWriteError
from phalanx.cluster import slurm_job
from phalanx.config import kinds
from phalanx.logging.rank_log import get_logger
from phalanx.runtime import collectives
from phalanx.runtime.context import AgentEnv
from phalanx.preemption.signals import SignalWatch
from phalanx.runtime.process_group import store_client
from phalanx.runtime.step_tracker import Phase, StepTracker

STORE_TIMEOUT = datetime.timedelta(seconds=60)
_STARTED = itertools.count()  # preemptions started in this process: the same count on every rank (SPMD)


class Preemption:
    """One rank's side of a preemption: hears signals, agrees on the step, saves, exits."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        checkpointer: Any,
        progress: StepTracker,
        cycle_idle: Callable[[], bool],
        busy: Callable[[str], Any],
        grace: float,
        agent: AgentEnv | None = None,
        poll_each_boundary: bool = False,
        generation: int = 0,
    ):
        self.rank = rank
        self.world_size = world_size
        self.checkpointer = checkpointer
        self.progress = progress
        self.cycle_idle = cycle_idle
        self.busy = busy
        self.grace = grace
        self.agent = agent or AgentEnv.from_env()
        self.poll_each_boundary = poll_each_boundary and world_size > 1
        self.requested: tuple[str, str | None] | None = None  # (signal name, what sent it)
        self.stop_at: int | None = None
        self._posted = False
        self._store: dist.Store | None = None
        self._batches_at_step: int | None = None
        self._step_at_last_batch: int | None = None  # global_step at the previous batch request
        self.watch: SignalWatch | None = None
        # keys of this Phalanx() only: an earlier one in this process (same attempt, same store) left its
        # agreement there, whose count and steps would decide this one's stop before every rank posted
        self._prefix = store_keys.preempt_prefix(self.agent.attempt, generation)
        self._requested_key = f"{self._prefix}/{store_keys.PREEMPT_REQUESTED}"

    # ---- hearing about it ----------------------------------------------------------------------
    def on_delivery(self, signum: int, count: int) -> None:
        """From the signal thread: the first delivery asks for a stop, the third ends the rank now."""
        name = signal.Signals(signum).name
        if count == 1:
            self.request(name)
        elif count == 2:
            print(
                f"phalanx (rank {self.rank}): {name} again; still finishing step and checkpoint. "
                "A third signal exits at once, without them",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"phalanx (rank {self.rank}): third signal ({name}): exiting now; a checkpoint being "
                "written is not finished, the previous one stays the latest",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)

    def request(self, name: str, reason: str | None = None) -> None:
        """Stop at the next agreed step boundary (idempotent: the first request wins)."""
        if self.requested is None:
            self.requested = (name, reason)
            get_logger().debug(
                "preemption: %s%s; stopping after an agreed step", name, f" ({reason})" if reason else ""
            )

    def poll(self, store: dist.Store) -> None:
        """Learn of a signal another rank received (the watchdog's thread calls this once a second)."""
        if self.requested is None and store.check([self._requested_key]):
            name, _, reason = store.get(self._requested_key).decode().partition("|")
            self.request(name, reason or None)

    # ---- step boundaries -----------------------------------------------------------------------
    def before_batch(self) -> None:
        """A prepared loader is about to read the next batch."""
        previous, self._step_at_last_batch = self._step_at_last_batch, self.checkpointer.global_step
        if self.requested is None:
            if not self.poll_each_boundary:
                return
            self.poll(self._own_store())
            if self.requested is None:
                return
        if self.world_size == 1 and previous == self.checkpointer.global_step:
            # No optimizer step since the previous batch: the middle of an evaluation loop (or of a
            # step that reads several batches), not a step boundary. Several ranks agree on a step
            # S after the current one, which only a finished step reaches; one alone waits likewise.
            return
        self._at_boundary()

    def after_step(self, *_: Any) -> None:
        """optimizer.step() returned: a boundary only for loops that take no prepared batches."""
        batches, self._batches_at_step = self._batches_at_step, self.progress.step
        if batches is None or batches != self.progress.step:
            return  # a prepared loader feeds this loop: its next batch is the boundary
        if self.requested is not None or self.poll_each_boundary:
            self.before_batch()

    def _at_boundary(self) -> None:
        if not self.cycle_idle():
            return  # inside an accumulation cycle: its gradients are not in the optimizer yet
        step = self.checkpointer.global_step
        if self.stop_at is None:
            self.stop_at = self._agree(step)
        if self.stop_at is not None and step >= self.stop_at:
            self._stop(step)

    def _agree(self, step: int) -> int | None:
        """Post this rank's step once; S = max(posted) + 1 once every rank has posted."""
        if self.world_size == 1:
            return step
        store = self._own_store()
        prefix = self._prefix
        if not self._posted:
            assert self.requested is not None
            name, reason = self.requested
            store.compare_set(self._requested_key, "", f"{name}|{reason or ''}")  # the first one tells the rest
            store.set(f"{prefix}/{store_keys.preempt_step_key(self.rank)}", str(step))
            store.add(f"{prefix}/{store_keys.PREEMPT_COUNT}", 1)
            self._posted = True
        if store.add(f"{prefix}/{store_keys.PREEMPT_COUNT}", 0) < self.world_size:
            return None
        keys = [f"{prefix}/{store_keys.preempt_step_key(r)}" for r in range(self.world_size)]
        return max(int(raw) for raw in store.multi_get(keys)) + 1

    def _own_store(self) -> dist.Store:
        if self._store is None:
            self._store = store_client(STORE_TIMEOUT)
        return self._store

    # ---- stopping --------------------------------------------------------------------------------
    def _stop(self, step: int) -> None:
        assert self.requested is not None
        name, reason = self.requested
        with self.busy(Phase.SAVE_STATE):
            outcome = self._save(step, name, reason)
            collectives.barrier()  # nobody leaves before the checkpoint is published
        line = outcome.line()
        get_logger().debug("%s", line)
        if self.agent.error_file:
            report.write(self.agent.error_file, outcome)
        if not self.agent.phalanx_launcher and self.rank == 0:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(outcome.exit_code)

    def _save(self, step: int, name: str, reason: str | None) -> report.PreemptionOutcome:
        root = self.checkpointer.directory
        target = root / atomic.step_dir_name(step)
        try:
            self.checkpointer.wait()  # an async save in flight is finished first
            # Decided on rank 0: every rank must take the same branch (the save is collective).
            exists = collectives.broadcast_object(atomic.is_published(target) if self.rank == 0 else None)
            if not exists:
                self.checkpointer.save(None, async_save=False)
        except CheckpointWriteError as error:
            return report.PreemptionOutcome(name, step, str(target), False, f"the checkpoint failed: {error}", reason)
        return report.PreemptionOutcome(name, step, str(target), True, None, reason)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.uninstall()
            self.watch = None


def start(
    *,
    signals: str,
    checkpointer: Any,
    rank: int,
    world_size: int,
    progress: StepTracker,
    cycle_idle: Callable[[], bool],
    busy: Callable[[str], Any],
    grace: float,
    watchdog: Any = None,
) -> Preemption | None:
    """Preemption for this rank when it is on (checkpoint_dir set, signals not 'none'), else None."""
    numbers = kinds.signal_numbers(signals)
    if not numbers or checkpointer.directory is None:
        return None
    preemption = Preemption(
        rank=rank,
        world_size=world_size,
        checkpointer=checkpointer,
        progress=progress,
        cycle_idle=cycle_idle,
        busy=busy,
        grace=grace,
        poll_each_boundary=watchdog is None,
        generation=next(_STARTED),
    )
    preemption.watch = SignalWatch(numbers, preemption.on_delivery)
    if not preemption.watch.install():
        preemption.watch = None
        get_logger().warning(
            "preemption: Phalanx() was created outside the main thread, so signals cannot be "
            "caught here; a rank that receives one stops the others through the store"
        )
    progress.on_batch_request = preemption.before_batch
    checkpointer.step_listeners.append(preemption.after_step)
    if watchdog is not None and world_size > 1:
        watchdog.add_listener(preemption.poll)
    if rank == 0:
        _arm_time_limit(preemption, grace)
    atexit.register(preemption.close)
    return preemption


def _arm_time_limit(preemption: Preemption, grace: float) -> None:
    """Under SLURM: ask for the stop `grace` seconds before the job's end time (also without --signal)."""
    try:
        end = slurm_job.end_time_here()
    except (OSError, ValueError, TimeoutError) as error:
        get_logger().warning("preemption: could not read the SLURM job's end time (%s); relying on signals", error)
        return
    if end is None:
        return
    left = end - time.time()
    if left <= grace:
        get_logger().warning(
            "preemption: the SLURM job ends in %.0f s, within preempt_grace (%.0f s): no save ahead of its time limit",
            left,
            grace,
        )
        return
    timer = threading.Timer(
        left - grace, preemption.request, args=("SIGUSR1", f"the SLURM job's time limit is {grace:.0f} s away")
    )
    timer.daemon = True
    timer.name = "phalanx-time-limit"
    timer.start()
