"""The watchdog thread at exit: it has ended before the process group is destroyed, even when its
store call is slow. (A daemon thread still inside a torch store call when the interpreter finalizes
aborts the process: "terminate called without an active exception", exit -6.)"""

from __future__ import annotations

import threading
import time

from phalanx.runtime.step_tracker import StepTracker
from phalanx.runtime.watchdog import Watchdog


class SlowStore:
    """A store whose `set` takes `delay` seconds once `slow` is set (a loaded or departing host)."""

    def __init__(self, delay: float):
        self.delay = delay
        self.slow = threading.Event()
        self.in_set = threading.Event()
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        if self.slow.is_set():
            self.in_set.set()
            time.sleep(self.delay)
        self.values[key] = value


def test_stop_waits_for_a_store_call_in_flight():
    store = SlowStore(delay=2.0)
    dog = Watchdog(store, rank=0, world_size=2, progress=StepTracker(), timeout=1.0).start()  # beats every 0.2 s
    store.slow.set()
    assert store.in_set.wait(5)  # the thread is now inside a 2 s store call
    dog.stop()
    assert not dog._thread.is_alive()  # it used to give up after 5 heartbeats (1 s) and leave it running


def test_leave_stops_the_thread_after_the_barrier_and_before_the_group_goes():
    store = SlowStore(delay=0.0)
    dog = Watchdog(store, rank=0, world_size=2, progress=StepTracker(), timeout=1.0).start()
    seen = []

    def destroy(before_destroy):
        seen.append(("barrier", dog._thread.is_alive()))  # still watched during the exit barrier
        before_destroy()
        seen.append(("destroy", dog._thread.is_alive()))

    dog.leave(destroy)
    assert seen == [("barrier", True), ("destroy", False)]
