"""launch/exit_times.py on real processes: each end to the millisecond, and the failures that are a
rank's own (ended before the launcher began stopping the workers), not the launcher's doing."""

from __future__ import annotations

import signal
import subprocess
import time
from types import SimpleNamespace

from phalanx.launch import exit_times


def _sleepers(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "30"]) for _ in range(n)]


def _wait_for(exits: exit_times.ExitTimes, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(exits.at) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_each_end_is_dated_in_the_order_it_came():
    procs = _sleepers(3)
    exits = exit_times.ExitTimes({local: p.pid for local, p in enumerate(procs)})
    try:
        for local in (2, 0):
            procs[local].kill()
            procs[local].wait()
            _wait_for(exits, 1 if local == 2 else 2)
            time.sleep(0.02)
        assert sorted(exits.at) == [0, 2] and exits.at[2] < exits.at[0]
    finally:
        exits.stop()
        for p in procs:
            p.kill()
            p.wait()


def _failure(exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode)


def test_ranks_the_launcher_stopped_are_not_failures_of_theirs():
    exits = exit_times.ExitTimes({})
    exits.at = {0: 10.5, 1: 10.0, 2: 10.7}
    exits.stopping_at = 10.2
    failures = {0: _failure(-signal.SIGTERM), 1: _failure(3), 2: _failure(1)}
    exit_times.own_failures(failures, SimpleNamespace(), [0, 1, 2], exits)
    # rank 0 ended by the launcher's SIGTERM; rank 2 ended after it began, but by its own exit 1
    assert sorted(failures) == [1, 2]


def test_nothing_is_dropped_without_every_end_time_or_when_nothing_would_be_left():
    exits = exit_times.ExitTimes({})
    exits.at, exits.stopping_at = {0: 10.5}, 10.2
    unknown = {0: _failure(-signal.SIGTERM), 1: _failure(3)}
    exit_times.own_failures(unknown, SimpleNamespace(), [0, 1], exits)
    assert sorted(unknown) == [0, 1]
    alone = {0: _failure(-signal.SIGKILL)}
    exit_times.own_failures(alone, SimpleNamespace(), [0], exits)
    assert sorted(alone) == [0]


def test_under_fork_the_ranks_torch_left_out_that_failed_on_their_own_are_added():
    """torch's fork context names one failed rank; the others that ended non-zero on their own join it."""
    processes = [SimpleNamespace(pid=100 + r, exitcode=code) for r, code in enumerate((1, 3, -signal.SIGTERM, 0))]
    pcontext = SimpleNamespace(_pc=SimpleNamespace(processes=processes), error_files={})
    exits = exit_times.ExitTimes({})
    exits.at = {0: 10.1, 1: 10.0, 2: 10.6, 3: 10.7}
    exits.stopping_at = 10.2
    failures = {1: _failure(3)}
    exit_times.own_failures(failures, pcontext, [0, 1, 2, 3], exits)
    assert sorted(failures) == [0, 1] and failures[0].exitcode == 1 and failures[0].pid == 100
