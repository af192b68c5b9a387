"""The watchdog judges only what it saw (issue 52: 8 ranks on 2 cores with `--watchdog-timeout 2`
were all reported "died (no heartbeat) at step -1, phase 'start'" while importing): a rank before its
first step gets a start grace, and time the judging thread itself did not look is nobody's silence.
The launcher-level case is tests/dist/test_failures.py::test_a_rank_that_holds_the_interpreter_
before_its_first_step_is_not_judged."""

from __future__ import annotations

import threading
import time

from phalanx import store_keys
from phalanx.runtime.step_tracker import StepTracker
from phalanx.runtime.verdict import START_GRACE_S, PeerView, judge
from phalanx.runtime.watchdog import Watchdog

NOW = 100.0


def view(step: int, phase: str, moved_ago: float, beat_ago: float) -> PeerView:
    return PeerView(record=(1, 1, step, phase), beat_at=NOW - beat_ago, moved_at=NOW - moved_ago)


def test_a_rank_before_its_first_step_is_judged_only_after_the_start_grace():
    importing = [view(0, "backward", 10.0, 0.1), view(-1, "start", 5.0, 5.0)]
    assert judge(importing, NOW, 2.0, me=0) is None  # its import holds the heartbeat: not dead at 5 s
    gone = [view(0, "backward", START_GRACE_S + 1, 0.1), view(-1, "start", START_GRACE_S + 1, START_GRACE_S + 1)]
    verdict = judge(gone, NOW, 2.0, me=0)
    assert verdict.dead == [1]
    assert verdict.headline.endswith("(timeout 2 s; 30 s before every rank's first step)")
    # Once every rank has begun, the timeout is the timeout again.
    assert judge([view(0, "backward", 10.0, 0.1), view(0, "step", 5.0, 5.0)], NOW, 2.0, me=0).dead == [1]


class PausingStore:
    """A store in a dict; rank 0's `set` of its record takes `pause` seconds once `slow` is set: the
    judging thread is not looking, as on a machine where every rank waits for a core."""

    def __init__(self, pause: float):
        self.pause = pause
        self.slow = threading.Event()
        self.resumed = threading.Event()
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        if key == store_keys.record_name(0) and self.slow.is_set():
            self.slow.clear()
            time.sleep(self.pause)
            self.resumed.set()
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[key] for key in keys]

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        self.values.setdefault(key, value.encode())
        return self.values[key]


def test_time_the_judging_thread_did_not_look_is_not_a_peers_silence():
    store = PausingStore(pause=3.0)
    progress = StepTracker()
    progress.step, progress.phase = 3, "backward"  # waiting in a collective: this rank reads its peers
    peer_beats = threading.Event()
    peer_beats.set()
    stop = threading.Event()

    def peer() -> None:  # rank 1 beats every 0.2 s while it gets the CPU, at the same place
        beat = 0
        while not stop.wait(0.2):
            if peer_beats.is_set():
                beat += 1
                store.set(store_keys.record_name(1), f"{beat}|7|3|backward")

    store.set(store_keys.record_name(1), "0|7|3|backward")
    verdicts: list[str] = []
    dog = Watchdog(store, rank=0, world_size=2, progress=progress, timeout=2.0)  # reads every 0.4 s
    dog._report = lambda verdict: (verdicts.append(verdict.headline), dog._stop.set())  # noqa: SLF001
    threads = [threading.Thread(target=peer, daemon=True)]
    threads[0].start()
    dog.start()
    try:
        time.sleep(2.0)  # watching its peer, which beats
        peer_beats.clear()  # the whole machine is held: the peer does not beat (the judge sees its
        time.sleep(0.5)  # last beat first), and the judge's next set takes 3 s, after which it
        store.slow.set()  # reads the peer's unchanged record at once
        assert store.resumed.wait(10)
        time.sleep(0.1)  # the judge has read the peer's record, unchanged since before the pause
        peer_beats.set()  # the machine is back: the peer beats again
        time.sleep(2.0)
    finally:
        stop.set()
        dog.stop()
    assert verdicts == [], verdicts  # was "rank 1 died (no heartbeat) at step 3" after the pause
