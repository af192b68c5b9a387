"""The async writer helper's polite writes (host_only/polite_writes.py): every byte reaches the
file unchanged, the helper sleeps between MiBs only while the training process is short of CPU,
and never more than MAX_WAIT_S a MiB; the CPU-shortage signal read from a real oversubscribed
process."""

import io
import os
import subprocess
import sys
import time

import pytest

from phalanx.host_only import polite_writes
from phalanx.host_only.polite_writes import CHUNK_BYTES, MAX_WAIT_S, PAUSE_S, LoopWatch, PoliteStream


class Answers:
    """A LoopWatch stand-in: busy() answers from a list, then False."""

    def __init__(self, *answers: bool):
        self.answers, self.asked = list(answers), 0

    def busy(self) -> bool:
        self.asked += 1
        return self.answers.pop(0) if self.answers else False


def test_bytes_reach_the_file_unchanged_and_the_rest_is_the_files():
    raw = io.BytesIO()
    stream = PoliteStream(raw, Answers())
    data = os.urandom(2 * CHUNK_BYTES + 12345)
    assert stream.write(b"head") == 4
    assert stream.write(memoryview(data)) == len(data)
    assert stream.write(bytearray(b"tail")) == 4
    assert raw.getvalue() == b"head" + data + b"tail"
    assert stream.tell() == len(data) + 8  # the raw stream's own
    assert stream.pauses == 0


def test_checks_once_per_mib_and_sleeps_only_while_busy():
    slept = []
    watch = Answers(True, True, False, True)  # busy twice at the first MiB, once at the second
    stream = PoliteStream(io.BytesIO(), watch, sleep=slept.append)
    stream.write(bytes(CHUNK_BYTES // 2))
    assert watch.asked == 0  # half a MiB: no check yet
    stream.write(bytes(CHUNK_BYTES // 2))
    assert watch.asked == 3 and slept == [PAUSE_S, PAUSE_S]
    stream.write(bytes(CHUNK_BYTES))
    assert watch.asked == 5 and stream.pauses == 3


def test_a_machine_that_never_idles_still_gets_its_save_written():
    slept = []
    stream = PoliteStream(io.BytesIO(), Answers(*[True] * 10_000), sleep=slept.append)
    stream.write(bytes(3 * CHUNK_BYTES))
    per_mib = round(MAX_WAIT_S / PAUSE_S)
    assert stream.pauses == len(slept) == 3 * per_mib
    assert sum(slept) == pytest.approx(3 * MAX_WAIT_S)


def test_busy_when_the_process_waited_more_than_a_quarter_of_the_time(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 2.001, 3.0]).__next__
    waits = iter([0, int(0.1e9), int(0.5e9), int(0.6e9)])
    read = []
    monkeypatch.setattr(LoopWatch, "waited_ns", lambda self: read.append(1) or next(waits))
    monkeypatch.setattr(polite_writes, "runnable_tasks", lambda: 0)
    watch = LoopWatch(os.getpid(), clock=clock)
    assert not watch.busy()  # waited 0.1 s of 1 s
    assert watch.busy()  # 0.4 s of 1 s
    assert watch.busy() and len(read) == 3  # 1 ms later: not read again, the verdict holds
    assert not watch.busy()  # 0.1 s of 1 s again


def test_busy_when_more_tasks_are_runnable_than_cpus(monkeypatch):
    monkeypatch.setattr(LoopWatch, "waited_ns", lambda self: None)  # no schedstat: the count alone
    monkeypatch.setattr(polite_writes, "runnable_tasks", lambda: (os.cpu_count() or 1) + 1)
    assert LoopWatch(os.getpid()).busy()
    monkeypatch.setattr(polite_writes, "runnable_tasks", lambda: 1)
    assert not LoopWatch(os.getpid()).busy()


def test_a_process_that_is_gone_reads_as_unknown():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert LoopWatch(child.pid).waited_ns() is None


@pytest.mark.timeout(60)
def test_an_oversubscribed_process_reads_as_short_of_cpu():
    """More spinning processes than CPUs: the first one waits for a CPU, and the watch says so."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 2)]
    try:
        watch = LoopWatch(spinners[0].pid)
        before = watch.waited_ns()
        assert before is not None
        seen_busy = False
        for _ in range(200):  # polls 20 ms apart, up to 4 s of spinning
            time.sleep(0.02)
            if watch.busy():
                seen_busy = True
                break
        assert seen_busy
        assert watch.waited_ns() > before
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
