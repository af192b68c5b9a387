"""Counting preemption signals in a thread of their own, so the third still acts when the main
thread is blocked (in a collective, in a slow write).

A Python signal handler runs only when the main thread next executes Python code, which may be
minutes away. So the handlers installed here do nothing themselves; the interpreter's C-level
handler also writes each signal's number to a pipe (`signal.set_wakeup_fd`), and a thread reading
that pipe counts deliveries at once. Deliveries less than `same_delivery_s` apart count once:
SLURM signals every process of a step while `phalanx run` forwards the same signal to its workers.
Where something else already owns the wakeup fd (an asyncio loop), or takes it over later (the
script, a notebook's event loop), the handlers count instead. A second `SignalWatch` (a second
`Phalanx()` in one process) replaces the first.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

SAME_DELIVERY_S = 1.0


class SignalWatch:
    """Calls `on_delivery(signum, count)` for each delivery of one of `signals` (count from 1)."""

    def __init__(
        self,
        signals: tuple[signal.Signals, ...],
        on_delivery: Callable[[int, int], None],
        same_delivery_s: float = SAME_DELIVERY_S,
    ):
        self.signals = signals
        self.numbers = {int(s) for s in signals}
        self.on_delivery = on_delivery
        self.same_delivery_s = same_delivery_s
        self.count = 0
        self._last: float | None = None
        # reentrant: where the handlers count (the wakeup fd is someone else's), a second delivery's
        # handler can run on the main thread between two bytecodes of the first one's `with` block
        self._lock = threading.RLock()
        self._previous: dict[signal.Signals, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> bool:
        """Take over the signals (main thread only; False elsewhere, changing nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for older in list(_watches):  # a second Phalanx() in this process (a notebook cell run again):
            older.uninstall()  # the newest owns the signals, else the older one's pipe would hear them
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone else's (asyncio): give it back, count in the handlers
            signal.set_wakeup_fd(previous_fd)
            os.close(read_end)
            os.close(write_end)
        else:
            self._pipe = (read_end, write_end)
            # the fd is handed over, not read from self._pipe: an uninstall (a second Phalanx()) may
            # have cleared that before a slow thread's first line runs
            self._thread = threading.Thread(target=self._read, args=(read_end,), name="phalanx-signals", daemon=True)
            self._thread.start()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        _watches.append(self)
        return True

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers and stop the thread (main thread)."""
        if self in _watches:
            _watches.remove(self)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            if self._pipe is not None:
                current = signal.set_wakeup_fd(-1)
                if current != self._pipe[1]:  # someone else's since: leave theirs in place
                    signal.set_wakeup_fd(current)
        self._previous.clear()
        if self._pipe is not None:
            os.close(self._pipe[1])  # the reader sees end-of-file and returns
            self._pipe = None

    def _handler(self, signum: int, frame: object) -> None:
        if self._pipe is None:  # no pipe of ours: count here, in the main thread
            self._delivered(signum)
            return
        # Is our pipe still the wakeup fd? The script (or a notebook's event loop) may have set its
        # own since: then this delivery went there, not to our thread, and is counted here. Theirs
        # is put back: set_wakeup_fd answers only by replacing.
        current = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        if current != self._pipe[1]:
            signal.set_wakeup_fd(current)
            self._delivered(signum)

    def _read(self, read_end: int) -> None:
        try:
            while True:
                data = os.read(read_end, 64)
                if not data:
                    return
                for number in data:
                    if number in self.numbers:
                        self._delivered(number)
        finally:
            os.close(read_end)

    def _delivered(self, signum: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.same_delivery_s:
                return
            self._last = now
            self.count += 1
            count = self.count
        self.on_delivery(signum, count)


_watches: list[SignalWatch] = []


def _in_forked_child() -> None:
    """A process forked from a worker (a DataLoader worker) must not write into the worker's pipe."""
    if _watches:
        signal.set_wakeup_fd(-1)
        for watch in _watches:
            for sig, handler in watch._previous.items():  # noqa: SLF001 - this module's own object
                signal.signal(sig, handler)  # type: ignore[arg-type]
        _watches.clear()


os.register_at_fork(after_in_child=_in_forked_child)
