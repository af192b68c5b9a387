"""The async writer helper's writes step aside while the training process waits for a CPU.

The helper runs in Linux's idle scheduling class, which should leave it only the cores the training
loop leaves idle. Measured on 2 cores with a loop using both (bench/checkpoint.py
--only-in-flight), an async save to a local disk still made the loop's steps 1.2-1.6x slower. A
scheduler trace (perf sched) showed why: the helper computing on one core while both of the loop's
threads queued on the other. A waking thread is placed beside the thread that woke it when every
core looks busy, and the balancer leaves a core running an idle-class task alone for tens of
milliseconds, so the loop's two threads took turns on one core.

So every MiB it writes, the helper checks whether the machine has more runnable tasks than CPUs, or
(at most every 10 ms) whether the training process's threads spent more than a quarter of the time
since the last reading waiting for a CPU (the run_delay of /proc/<pid>/task/*/schedstat, which sees
a CPU set smaller than the machine's); while so, it sleeps
a millisecond at a time, which leaves its core idle: the kernel then moves a waiting thread there.
It never waits more than 50 ms a MiB, so a save always progresses (at least 20 MiB/s). Without
schedstat (a kernel without schedstats) only the count of runnable tasks is checked; without /proc
(not Linux) it writes straight on.

Host-only (phalanx/host_only/): the helper is polite only when the training process runs on the
host's cores (`engages`: its backend is gloo); a CUDA job's loop runs on its GPU and the helper
writes straight on (writer_process.py decides per save, in the training process).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator

from phalanx.host_only import engages

CHUNK_BYTES = 2**20  # checked once per MiB written: ~2 ms of the helper's work (hash, copy)
PAUSE_S = 0.001  # one sleep: short, so a core that frees up is used again at once
MAX_WAIT_S = 0.05  # per MiB: the floor under a save's speed (20 MiB/s) on a machine that never idles
BUSY_SHARE = 0.25  # the loop waited this share of the time since the last check: it wants the core
RUN_DELAY_EVERY_S = 0.01  # the loop's waits are read at most this often (~0.3 ms for 60 threads)


class LoopWatch:
    """Whether the process `pid` (the training process) is short of CPU right now."""

    def __init__(self, pid: int, clock: Callable[[], float] = time.monotonic):
        self.pid, self._clock = pid, clock
        self._cpus = os.cpu_count() or 1
        self._last = (self._clock(), self.waited_ns())
        self._waited_long = False

    def waited_ns(self) -> int | None:
        """The total time the process's threads have spent runnable but not running, in ns (None:
        not readable here)."""
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        total = 0
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[1])
            except (OSError, ValueError, IndexError):  # a thread that just ended
                continue
        return total

    def busy(self) -> bool:
        """True if more tasks are runnable on this machine than it has CPUs, or the process waited
        for a CPU more than BUSY_SHARE of the time between its last two readings of its waits
        (taken at most every RUN_DELAY_EVERY_S: reading them opens a file per thread)."""
        if runnable_tasks() > self._cpus:
            return True
        now = self._clock()
        then, before = self._last
        if now - then < RUN_DELAY_EVERY_S:
            return self._waited_long  # the last reading's verdict holds until the next
        waited = self.waited_ns()
        self._last = (now, waited)
        self._waited_long = (
            waited is not None and before is not None and waited - before > BUSY_SHARE * (now - then) * 1e9
        )
        return self._waited_long


def runnable_tasks() -> int:
    """Tasks running or waiting for a CPU on this machine (/proc/stat's procs_running; 0 if unknown)."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class PoliteStream:
    """A write stream that hands `raw` its bytes a MiB at a time and steps aside between them while
    `watch` says the training process is short of CPU. Everything else is `raw`'s (tell, fileno)."""

    def __init__(self, raw: Any, watch: LoopWatch, sleep: Callable[[float], None] = time.sleep):
        self._raw, self._watch, self._sleep = raw, watch, sleep
        self._since_check = 0
        self.pauses = 0  # how many sleeps this stream took (for tests and benches)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, CHUNK_BYTES):
            piece = view[start : start + CHUNK_BYTES]
            self._raw.write(piece)
            self._since_check += piece.nbytes
            if self._since_check >= CHUNK_BYTES:
                self._since_check = 0
                self._step_aside()
        return view.nbytes

    def _step_aside(self) -> None:
        for _ in range(round(MAX_WAIT_S / PAUSE_S)):
            if not self._watch.busy():
                return
            self._sleep(PAUSE_S)
            self.pauses += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def polite(fs: Any, watch: LoopWatch) -> Any:
    """DCP's FileSystem `fs` (local or fsspec), its written files PoliteStreams watching `watch`."""
    plain_create_stream = fs.create_stream

    @contextlib.contextmanager
    def create_stream(path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with plain_create_stream(path, mode) as stream:
            yield PoliteStream(stream, watch) if "w" in mode else stream

    fs.create_stream = create_stream
    return fs


def engages_here() -> bool:
    """Whether the training process (this one, saving) runs its loop on the host's cores: its default
    process group's backend engages host-only code (gloo), or, without a group, CUDA is not in use."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # a world of one's group is gloo
        return engages(str(dist.get_backend()))
    return not torch.cuda.is_initialized()
