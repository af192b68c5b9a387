"""The watchdog: a thread per rank that says who stalled or died, where, within seconds.

Every rank's thread publishes a heartbeat and its progress (step, phase; see progress.py) to the
store the launcher already runs (the default process group's store: no new server), once per
`interval`. As long as the rank's own progress moves, that is all it does: one small `set` per
second. Once this rank itself has stood still for a moment (it is stalled, or waiting for someone
who is), its thread also reads the peers' records. When no rank has progressed for `timeout`
seconds and the ranks are not all at the same place (someone waits in a collective that another
never reached), or a rank has stopped sending heartbeats, one rank wins the right to report:

    phalanx watchdog: rank 1 stalled at step 3 (phase 'step': in the training script, between
    phalanx calls) while the other ranks waited for 5.1 s
      rank 0: step 3, phase 'backward' (waiting)
      rank 1: step 3, phase 'step'  <-- stalled
    Python stack of each rank at that moment: ...

every live rank adds its Python stack to the store, the reporter prints the report (and records it
in TORCHELASTIC_ERROR_FILE for the launcher), and all ranks exit with code EXIT_CODE. Under pipeline
parallel each rank is named with its stage(s) too: `rank 1 (pipeline stage 1 of 2) stalled at ...`.

All ranks at the same step and phase for a long time (a long evaluation, a slow first compile) is
not a hang the watchdog can tell from work: the collective timeout remains the backstop there. Where
that backstop has no hold (every rank inside a communicating phase such as 'backward', waiting on
something no collective timeout covers), the watchdog reports once the ranks have sat there longer
than the collective timeout plus its own (`stuck_after`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from phalanx import store_keys
from phalanx.runtime.children import describe_children
from phalanx.runtime.process_group import ignoring_sigint, leaving_cleanly, store_client
from phalanx.runtime.context import AgentEnv
from phalanx.runtime.step_tracker import Phase, StepTracker
from phalanx.runtime.verdict import LEFT, LEFT_LOOP, PeerView, Verdict, at_step, judge

EXIT_CODE = 3  # a rank stopped by the watchdog (1 stays "the script raised")


class Watchdog:
    """The reporting thread of one rank. `start()` after the process group exists."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        progress: StepTracker,
        timeout: float,
        stuck_after: float | None = None,
        labels: list[str] | None = None,
        group_alive: Callable[[], bool] = lambda: True,
    ):
        self.store = store
        self.labels = labels  # per rank, what else names it in a report (its pipeline stage)
        self.group_alive = group_alive  # False once the watched group is destroyed: nothing left to watch
        self.stuck_after = stuck_after
        self.rank = rank
        self.world_size = world_size
        self.progress = progress
        self.timeout = timeout
        self.interval = min(1.0, timeout / 5)
        self.store_timeout_s = max(30.0, timeout)  # how long one store call may block
        self._stop = threading.Event()
        self._publishing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="phalanx-watchdog", daemon=True)
        self._beat = 0
        self._peers = [PeerView() for _ in range(world_size)]
        self._watching_since: float | None = None
        self._looked_at = 0.0  # when this thread last read the peers' records
        self._failed_at: float | None = None  # unix time of this rank's uncaught exception
        self._listeners: list[Callable[[dist.Store], None]] = []
        self.on_report: list[Callable[[str], None]] = []  # the report, before this rank stops the job

    def add_listener(self, fn: Callable[[dist.Store], None]) -> None:
        """Call `fn(store)` after each heartbeat, in this thread, with the unprefixed store: a check
        that must run about once a second piggybacks here instead of needing a thread of its own."""
        self._listeners.append(fn)

    # ---- lifetime ------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._publish()  # before the thread: peers find this rank's record from the start
        self.progress.on_busy = self.publish_now
        self._thread.start()
        return self

    def publish_now(self) -> None:
        """Publish this rank's record from the calling thread (the main one, entering long work
        such as a save): if it dies inside that work, its peers read that phase, not the one of
        the last heartbeat. A store that fails here is the heartbeat thread's to report."""
        if self._stop.is_set():
            return
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the record is a detail of a later report, never a reason to fail
            pass

    def stop(self) -> None:
        """Stop the thread and wait until it has ended.

        Never return while the thread may still be inside a store call: a daemon thread that is
        in a torch call when the interpreter finalizes aborts the process ("terminate called
        without an active exception", exit -6: the flaky test_uneven failure). Each store call
        ends within the store's timeout, so this wait is bounded; normally it takes microseconds.
        """
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.store_timeout_s + 2 * self.interval)

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_ticks, moved_at = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            if not self.group_alive():
                return  # the script ended the group (one it created: mp.spawn): nothing left to watch
            try:
                self._publish()
                for listener in self._listeners:
                    listener(self.store.underlying_store)
                now = time.monotonic()
                ticks = self.progress.ticks
                if ticks != last_ticks or self.progress.busy:
                    last_ticks, moved_at, self._watching_since = ticks, now, None
                    continue
                if now - moved_at < 2 * self.interval:
                    continue  # moving: peers are not this rank's business
                self._watch_peers(now)
            except Exception as error:  # noqa: BLE001 - reported below, never hidden
                if self._stop.is_set() or self.progress.phase in LEFT or not self.group_alive():
                    return  # the store's host finished first at exit, or the script ended its group
                _stop_process(
                    f"phalanx watchdog (rank {self.rank}): lost the rendezvous store: "
                    f"{type(error).__name__}: {error}\nIts host (the launcher's agent, or rank 0 "
                    "when started without one) has probably died; stopping this rank.",
                    show=True,
                )

    def _not_looking(self, lost: float) -> None:
        """This thread did not look for `lost` seconds beyond its wait (not scheduled on a machine
        with more ranks than cores, a slow store call, a stopped process): the peers' silence then
        is not theirs, as they were likely held too. Without this, 8 ranks on 2 cores read each
        other as dead ("no heartbeat") when each woke before the others had beaten again."""
        for view in self._peers:
            view.beat_at += lost
            view.moved_at += lost

    def _publish(self) -> None:
        with self._publishing:  # the heartbeat thread and publish_now: one record at a time, in order
            self._beat += 1
            p = self.progress
            ticks = p.ticks + self._beat if p.busy else p.ticks  # busy on purpose: counts as moving
            self.store.set(store_keys.record_name(self.rank), f"{self._beat}|{ticks}|{p.step}|{p.phase}")

    def _watch_peers(self, now: float) -> None:
        if self.store.check([store_keys.VERDICT]):
            self._follow(self.store.get(store_keys.VERDICT).decode())
            return
        if self._watching_since is None:
            self._watching_since = now
            for view in self._peers:
                view.beat_at = view.moved_at = now  # unknown before: count from now
        elif now - self._looked_at > 2 * self.interval:
            self._not_looking(now - self._looked_at - self.interval)
        self._looked_at = now
        self._read_peers(now)
        verdict = judge(self._peers, now, self.timeout, self.rank, self.stuck_after, self.labels)
        if verdict is None:
            return
        won = self.store.compare_set(store_keys.VERDICT, "", verdict.headline).decode() == verdict.headline
        if won:
            self._report(verdict)
        else:
            self._follow(self.store.get(store_keys.VERDICT).decode())

    def _read_peers(self, now: float) -> None:
        keys = [store_keys.record_name(r) for r in range(self.world_size)]
        for rank, raw in enumerate(self.store.multi_get(keys)):
            beat, ticks, step, phase = raw.decode().split("|", 3)
            record = (int(beat), int(ticks), int(step), phase)
            view = self._peers[rank]
            if view.record is None or record[0] != view.record[0]:
                view.beat_at = now
            if view.record is None or record[1] != view.record[1]:
                view.moved_at = now
            view.record = record

    # ---- stopping everyone -----------------------------------------------------------------
    def _report(self, verdict: Verdict) -> None:
        self.store.set(store_keys.stack_name(self.rank), rank_snapshot())
        waiting_for = [r for r in range(self.world_size) if r != self.rank and r not in verdict.dead]
        deadline = time.monotonic() + max(3.0, 3 * self.interval)
        while time.monotonic() < deadline and not all(
            self.store.check([store_keys.stack_name(r)]) for r in waiting_for
        ):
            time.sleep(0.05)
        stacks = []
        for r in range(self.world_size):
            text = (
                self.store.get(store_keys.stack_name(r)).decode()
                if self.store.check([store_keys.stack_name(r)])
                else "(no stack: the rank did not answer)\n"
            )
            stacks.append(f"--- rank {r} (main thread, most recent call last) ---\n{text}")
        report = "\n".join([verdict.headline, *verdict.lines, "Python stack of each rank at that moment:", *stacks])
        self.store.set(store_keys.REPORT, report)
        for hook in self.on_report:
            hook(report)
        _announce(report, show=True)
        self.store.set(store_keys.REPORTED, "1")
        os._exit(EXIT_CODE)  # first: a launcher then names this rank, with the report, as the root cause

    def _follow(self, headline: str) -> None:
        """Another rank reports: give it this rank's stack, wait for its report, then stop.

        Stops this rank whatever happens meanwhile (the reporter may take the store down with it).
        """
        message = f"phalanx watchdog stopped rank {self.rank}; the report: {headline}"
        try:
            self.store.set(store_keys.stack_name(self.rank), rank_snapshot())
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and not self.store.check([store_keys.REPORTED]):
                time.sleep(0.05)
            # The full report in this rank's error file too: a launcher that names only one failed
            # rank (torch's fork start method names the lowest) shows it whichever rank it picks.
            message = self.store.get(store_keys.REPORT).decode()
            _announce(message, show=False)
            time.sleep(1.0)  # let the reporter exit first (a launcher lists the first failure first)
        finally:
            _stop_process(message, show=False)

    # ---- at the end of the script ------------------------------------------------------------
    def failed(self, exc_type: type) -> None:
        """This rank is ending with an uncaught exception: tell the peers, and if it is a
        RuntimeError (how a collective fails when a peer is gone), name the peer that went first.

        Explaining takes a few heartbeats, which also lets the root cause exit first, so a launcher
        lists it first."""
        if self.progress.phase == Phase.FAILED:
            return  # already explained (excepthook, then atexit)
        self.progress.enter(Phase.FAILED)
        self.stop()
        self._failed_at = time.time()
        try:
            # The moment, to the microsecond: peers and the launcher order failures by it.
            self.store.set(store_keys.failed_name(self.rank), f"{self._failed_at:.6f}|{self.progress.step}")
            self._publish()  # peers learn at once that this rank failed, and at which step
        except Exception:  # noqa: BLE001 - the store's host may be gone already; the exit goes on
            return
        if issubclass(exc_type, RuntimeError):
            note = explain_failure(self)
            if note:
                print(note, file=sys.stderr, flush=True)

    def mark_leaving(self) -> None:
        """This rank has left its script cleanly: whether it ran out of data or left with batches
        unread (a break, return, sys.exit). Exit hooks that wait (observe's last table) call it
        first, so their wait is never taken for a stall."""
        if leaving_cleanly():
            self.progress.enter(Phase.EXIT_MID_PASS if self.progress.mid_pass else LEFT_LOOP)

    def leave(self, destroy) -> None:
        """Mark this rank as out of its loop, pass the exit barrier while still watched, stop the
        thread, then leave the group.

        The thread ends before the group (and on its host, the store) is torn down, so it never
        uses a store that is going away and is never left inside a store call at interpreter exit.
        A failed teardown (a peer died or was stopped meanwhile) must not end in exit code 0,
        which is what an exception in an atexit handler would give: exit with EXIT_CODE instead.
        """
        exc_type = sys.exc_info()[0]
        with ignoring_sigint():  # a second Ctrl-C must not cut the exit path short (see there)
            if not leaving_cleanly():  # leaving because of an exception (forked workers get here)
                self.failed(exc_type)
            else:
                self.mark_leaving()
            try:
                destroy(before_destroy=self.stop)
            except Exception as error:  # noqa: BLE001 - reported and turned into a failing exit code
                self.stop()
                _stop_process(
                    f"phalanx (rank {self.rank}): leaving the process group failed: {type(error).__name__}: {error}",
                    show=True,
                )
            self.stop()


def rank_snapshot() -> str:
    """The main thread's stack, then what this rank's child processes are doing (DataLoader
    workers, a writer helper): a rank waiting on its loader's queue waits on them."""
    children = describe_children()
    if not children:
        return main_thread_stack()
    return main_thread_stack() + "Its child processes:\n" + "".join(f"  {line}\n" for line in children)


def main_thread_stack() -> str:
    """The main thread's Python stack, from the training script's `__main__` on.

    The frames above it (runpy, the launcher's worker wrapper, a forked agent's multiprocessing
    machinery) are the same on every rank and say nothing about the hang.
    """
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001
    if frame is None:
        return "(main thread has ended)\n"
    frames = traceback.extract_stack(frame)
    starts = [i for i, f in enumerate(frames) if f.filename == "<frozen runpy>" or f.filename.endswith("runpy.py")]
    if starts and starts[-1] + 1 < len(frames):
        frames = frames[starts[-1] + 1 :]
    return "".join(traceback.format_list(frames))


def _announce(message: str, show: bool) -> None:
    """Record `message` in TORCHELASTIC_ERROR_FILE, which the launcher prints in its summary (so the
    report appears once), or else print it (if `show`)."""
    error_file = AgentEnv.from_env().error_file
    if show and not error_file:
        print(message, file=sys.stderr, flush=True)
    if error_file:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            raise RuntimeError(message)
        except RuntimeError as error:
            ErrorHandler().record_exception(error)
    sys.stdout.flush()


def _stop_process(message: str, show: bool) -> None:
    """Announce `message` and end this rank now.

    os._exit: the main thread is blocked in a collective that will never finish, so a normal exit
    (atexit handlers, process-group teardown) would block too.
    """
    _announce(message, show)
    os._exit(EXIT_CODE)


def explain_failure(watchdog: Watchdog) -> str | None:
    """After a collective error: name the peers whose heartbeat stopped (they died first), if any.

    Two reads of the peers' records, a few heartbeats apart: a rank whose heartbeat did not move
    is gone, and this rank's error is most likely the consequence.
    """
    keys = [store_keys.record_name(r) for r in range(watchdog.world_size)]
    first = watchdog.store.multi_get(keys)
    time.sleep(3 * watchdog.interval)
    second = watchdog.store.multi_get(keys)
    mine = watchdog._failed_at or time.time()  # noqa: SLF001
    failed, silent = [], []
    for rank, (a, b) in enumerate(zip(first, second)):
        if rank == watchdog.rank or a != b:
            continue
        _, _, step, phase = b.decode().split("|", 3)
        if phase == "failed":
            # Only a peer that failed before this rank can be the cause; one that failed later (or
            # at once, in the same collective) is a consequence or a coincidence, never the cause.
            key = store_keys.failed_name(rank)
            note = store_keys.parse(None, watchdog.store.get(key) if watchdog.store.check([key]) else None)
            if note.failed_at is not None and note.failed_at < mine:
                failed.append(
                    f"rank {rank} raised an exception at {at_step(int(step))}, "
                    f"{mine - note.failed_at:.1f} s before this rank's error"
                )
        else:
            silent.append(
                f"rank {rank} stopped sending heartbeats at {at_step(int(step))}, phase {phase!r} "
                "(killed by a signal? out of memory?)"
            )
    if not failed and not silent:
        return None
    return (
        f"phalanx watchdog: {'; '.join(failed + silent)}. This rank's error "
        f"(rank {watchdog.rank}) is most likely a consequence: look at that rank's own error first."
    )


def _explain_uncaught_errors(watchdog: Watchdog) -> None:
    """On an uncaught exception (plain `python`, spawned workers), tell peers and explain."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        watchdog.failed(exc_type)

    sys.excepthook = hook


def start_watchdog(
    rank: int,
    world_size: int,
    progress: StepTracker,
    timeout: float,
    destroy,
    collective_timeout: float | None = None,
    labels: list[str] | None = None,
) -> Watchdog | None:
    """Start watching when there is a group and a timeout; `destroy` leaves the group at exit.
    With `collective_timeout`, ranks all stuck in a communicating phase for longer than it plus
    `timeout` are reported too. `labels`: per rank, named next to it in reports (pipeline stages)."""
    if timeout == 0 or world_size == 1 or not dist.is_initialized():
        return None
    if _running:  # a second Phalanx() in this process takes over this rank's record
        _running.pop().stop()
    # Per restart attempt: records and verdicts of a previous attempt must never be read as this one's.
    agent = AgentEnv.from_env()
    prefix = store_keys.watchdog_prefix(agent.attempt)
    store_timeout = timedelta(seconds=max(30.0, timeout))  # = Watchdog.store_timeout_s
    # Unprefixed below: the launcher reads the records back under store_keys' names.
    store = dist.PrefixStore(prefix, store_client(store_timeout))
    store.set_timeout(store_timeout)
    stuck_after = None if collective_timeout is None else collective_timeout + timeout
    watchdog = Watchdog(
        store, rank, world_size, progress, timeout, stuck_after, labels, group_alive=dist.is_initialized
    ).start()
    atexit.register(watchdog.leave, destroy)  # runs before the process group's own exit hook
    _explain_uncaught_errors(watchdog)
    _running.append(watchdog)
    return watchdog


_running: list[Watchdog] = []  # this process's watchdog: there is one rank per process
