"""When each worker process ended, to the millisecond, and every rank that ended on its own: how the
launcher names the rank that failed first, under every start method.

torch's agent cannot say it. Under spawn it records each failure's time in whole seconds, the
failures it found first and the workers it then stopped itself (SIGTERM) alike, so a rank that
exited 3 and the rank 0 the agent stopped a moment later tie, and rank order put rank 0 first (exit
143). Under fork it names one failed rank, whichever the kernel listed first among those already
gone: the rank whose collective failed because its peer had left, as often as the peer.

So the agent watches its workers' pidfds from one thread (`ExitTimes`): a worker's end wakes it at
once, and the end of the cause comes before the end of every consequence (a peer's collective
fails only once the cause's process, and its sockets, are gone). It also notes when the launcher
began stopping the workers (`stopping`: torch's close, multiprocessing's terminate, phalanx's own
kill before a restart). `own_failures` then keeps the failures of ranks that ended before that,
under fork too (where torch lists one): the ranks the launcher stopped are no failures of theirs,
and both start methods name the same ranks.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Any


def worker_states(pcontext: Any) -> list[tuple[int, int | None]]:
    """(pid, exit code or None while running) of each worker of torch's process context, by local rank."""
    if pcontext is None:
        return []
    processes = getattr(pcontext, "_pc", None)  # MultiprocessContext (fork): multiprocessing processes
    if processes is not None:
        return [(p.pid, p.exitcode) for p in processes.processes]
    handlers = getattr(pcontext, "subprocess_handlers", {})  # SubprocessContext (spawn): Popen objects
    return [(handlers[rank].proc.pid, handlers[rank].proc.poll()) for rank in sorted(handlers)]


class ExitTimes:
    """Unix time each watched worker ended (`at`, by local rank), from a thread polling pidfds.

    Nothing is recorded where pidfds are missing (not Linux, a kernel before 5.3): the report then
    orders failures as torch dates them."""

    def __init__(self, pids: dict[int, int]) -> None:
        self.at: dict[int, float] = {}
        self.stopping_at: float | None = None  # when the launcher first signalled its workers
        self._fds: dict[int, int] = {}  # pidfd -> local rank
        for local_rank, pid in pids.items():
            try:
                self._fds[os.pidfd_open(pid)] = local_rank
            except ProcessLookupError:  # gone and reaped already
                self.at[local_rank] = time.time()
            except (AttributeError, OSError):  # no pidfds here: no times at all, never some
                self.close_fds()
                self.at.clear()
                return
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="phalanx-exit-times", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        for fd in (*self._fds, self._wake_read):
            poller.register(fd, select.POLLIN)
        woken = False
        while self._fds and not woken:
            ready = poller.poll()  # every end already there comes in one answer, with a wake-up
            now = time.time()
            for fd, _ in ready:
                if fd == self._wake_read:
                    woken = True
                    continue
                self.at.setdefault(self._fds.pop(fd), now)
                poller.unregister(fd)
                os.close(fd)

    def stopping(self) -> None:
        """The launcher is about to signal its workers: ends after this are its doing."""
        if self.stopping_at is None:
            self.stopping_at = time.time()

    def watch_stopping(self, pcontext: Any) -> None:
        """Call `stopping` first wherever torch signals the workers of `pcontext`: its close (spawn
        and fork), and multiprocessing's terminate, which torch's fork context calls before it."""
        for obj, name in [(pcontext, "close"), *((p, "terminate") for p in _processes(pcontext))]:
            original = getattr(obj, name)

            def first_note(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.stopping()
                return _original(*args, **kwargs)

            setattr(obj, name, first_note)

    def stop(self) -> None:
        """End the thread (the workers are gone or being stopped) and close its descriptors."""
        if not hasattr(self, "_thread"):
            return
        os.write(self._wake_write, b"x")
        self._thread.join(timeout=5)
        self.close_fds()
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        del self._thread

    def close_fds(self) -> None:
        for fd in list(self._fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


# how a worker the launcher stops ends: torch's SIGTERM, then SIGKILL (also phalanx's before a
# restart), or a script's own handler exiting 128 + the signal; any other end is the rank's own
_STOPPED_BY = frozenset({-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL})


def _processes(pcontext: Any) -> list[Any]:
    processes = getattr(pcontext, "_pc", None)  # MultiprocessContext (fork)
    return list(processes.processes) if processes is not None else []


def own_failures(failures: dict[int, Any], pcontext: Any, global_ranks: list[int], exits: ExitTimes) -> None:
    """Make `failures` (torch's, by global rank; `global_ranks` by local rank) the ranks that ended
    non-zero on their own, before the launcher began stopping them: under fork add those torch left
    out (it lists one), under both drop those the launcher stopped (ended after it began, by its
    signal). Unchanged when an end time is missing (no pidfds) or nothing would be left."""
    by_local = {local: rank for local, rank in enumerate(global_ranks)}
    ended_at = {by_local[local]: at for local, at in exits.at.items()}
    stop = exits.stopping_at if exits.stopping_at is not None else float("inf")

    def stopped(rank: int, code: int) -> bool:  # ended once the launcher was stopping, by its signal
        return ended_at[rank] >= stop and code in _STOPPED_BY

    if _processes(pcontext):
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        error_files = getattr(pcontext, "error_files", {})
        for local_rank, (pid, code) in enumerate(worker_states(pcontext)):
            rank = global_ranks[local_rank]
            if rank not in failures and code not in (None, 0) and rank in ended_at and not stopped(rank, code):
                error_file = error_files.get(local_rank, "")
                failures[rank] = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code, error_file=error_file)
    if not all(rank in ended_at for rank in failures):
        return
    dropped = [rank for rank, failure in failures.items() if stopped(rank, failure.exitcode)]
    if len(dropped) < len(failures):
        for rank in dropped:
            del failures[rank]
