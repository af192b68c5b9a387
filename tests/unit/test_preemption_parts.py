"""Preemption's parts without a job: the settings, the line, the agreement on the stop step over a
real store, signal counting, the launcher's signal list and SLURM's end time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from phalanx import config
from phalanx import preemption_report as report
from phalanx.cluster import slurm_job
from phalanx.config import kinds
from phalanx.launch import preemption as launch_preemption
from phalanx.preemption import worker as preemption
from phalanx.runtime.context import AgentEnv
from phalanx.preemption.signals import SignalWatch
from phalanx.runtime.step_tracker import StepTracker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "given, canonical",
    [
        ("SIGTERM,SIGUSR1", "SIGTERM,SIGUSR1"),
        ("term, usr1", "SIGTERM,SIGUSR1"),
        ("15", "SIGTERM"),
        ("none", "none"),
        (["SIGUSR2", "SIGTERM", "SIGUSR2"], "SIGUSR2,SIGTERM"),
    ],
)
def test_signal_lists_are_read_into_one_spelling(given, canonical):
    value = kinds.SIGNALS.from_text(given) if isinstance(given, str) else kinds.SIGNALS.from_object(given)
    assert value == canonical
    assert kinds.signal_numbers(value) == tuple(signal.Signals[n] for n in canonical.split(",") if n != "none")


@pytest.mark.parametrize(
    "given, message",
    [
        ("SIGKILL", "SIGKILL cannot be caught, so nothing could be saved on it"),
        ("SIGSTOP", "SIGSTOP cannot be caught"),
        ("SIGTERM,SIGFOO", "SIGFOO is not a signal; use names such as SIGTERM,SIGUSR1,SIGUSR2, or none"),
        ("", "expected signal names such as SIGTERM,SIGUSR1, or none"),
    ],
)
def test_signals_that_do_not_exist_or_cannot_be_caught_are_refused(given, message):
    with pytest.raises(config.ConfigError, match=message):
        config.resolve(config.from_env({"PHALANX_PREEMPTION_SIGNALS": given or ","}))


@pytest.mark.parametrize("flag", ["SIGKILL", "9", "SIGFOO"])
def test_phalanx_run_refuses_them_before_launch_in_one_line(tmp_path, flag):
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "--preemption-signals", flag, "missing.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"phalanx run: error: --preemption-signals {flag}: ")
    assert "use catchable signals such as SIGTERM,SIGUSR1, or none" in proc.stderr or "is not a signal" in proc.stderr


def test_the_line_and_its_error_file_round_trip(tmp_path):
    saved = report.PreemptionOutcome("SIGTERM", 17, "ckpt/step-00000017", True)
    assert saved.line() == (
        "phalanx: preempted by SIGTERM at step 17: checkpoint ckpt/step-00000017 saved; run the same command to resume"
    )
    assert saved.exit_code == 143
    assert report.PreemptionOutcome("SIGUSR1").exit_code == 138
    report.write(str(tmp_path / "error.json"), saved)
    import json

    data = json.loads((tmp_path / "error.json").read_text())
    assert data["message"]["message"] == saved.line()  # what torch's agent shows as the failure's message
    assert report.from_error_file_data(data) == saved
    assert report.from_error_file_data({"message": "<NONE>"}) is None
    late = report.PreemptionOutcome(
        "SIGUSR1", 5, "c/step-00000005", True, reason="the SLURM job's time limit is 120 s away"
    )
    assert late.line("requeued").startswith(
        "phalanx: preempted by SIGUSR1 (the SLURM job's time limit is 120 s away) "
        "at step 5: checkpoint c/step-00000005 saved; requeued"
    )


def test_without_checkpoint_dir_the_launcher_says_nothing_was_saved_and_why():
    stopper = launch_preemption.Stopper((signal.SIGTERM,), grace=5.0, checkpoint_dir=None)
    stopper.signal = signal.SIGTERM
    outcome = stopper.final()
    assert outcome.exit_code == 143
    assert outcome.line().startswith(
        "phalanx: preempted by SIGTERM: nothing was saved: no checkpoint_dir is set. HINT: with --checkpoint-dir DIR"
    )


def test_phalanx_takes_its_signals_out_of_torch_s_list():
    assert (
        launch_preemption.without_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT", (signal.SIGTERM, signal.SIGUSR1))
        == "SIGINT,SIGHUP,SIGQUIT"
    )


class _Stopped(Exception):
    pass


def _rank(store: dist.Store, rank: int, world: int, generation: int = 0) -> preemption.Preemption:
    checkpointer = SimpleNamespace(global_step=0, directory=Path("/nonexistent"))
    p = preemption.Preemption(
        rank=rank,
        world_size=world,
        checkpointer=checkpointer,
        progress=StepTracker(),
        cycle_idle=lambda: True,
        busy=None,
        grace=1.0,
        agent=AgentEnv(attempt="7"),
        generation=generation,
    )
    p._store = store

    def stop(step: int) -> None:
        raise _Stopped(step)

    p._stop = stop  # type: ignore[method-assign]
    return p


def _boundary(p: preemption.Preemption, step: int) -> int | None:
    """Rank at the boundary after `step` steps: None if it trains on, else the step it stops after."""
    p.checkpointer.global_step = step
    try:
        p.before_batch()
    except _Stopped as stopped:
        return stopped.args[0]
    return None


def test_ranks_agree_on_one_step_though_they_heard_of_it_at_different_steps():
    """Rank 0 gets the signal at step 10; rank 1 learns of it from the store a step later. Both stop
    after step 12 = max(10, 11) + 1, each checking only the store while a stop is pending."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    a = _rank(server, 0, 2)
    b = _rank(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10)), 1, 2)
    assert _boundary(a, 9) is None and _boundary(b, 9) is None  # nothing requested: no store call at all
    a.request("SIGTERM")
    assert _boundary(a, 10) is None  # posts 10; rank 1 has not posted
    assert _boundary(b, 10) is None  # rank 1 knows nothing yet
    b.poll(b._store)  # the watchdog thread's once-a-second check
    assert b.requested == ("SIGTERM", None)
    assert _boundary(b, 11) is None and b.stop_at == 12  # posts 11; both posted: stop after 12
    assert _boundary(a, 11) is None and a.stop_at == 12
    assert _boundary(a, 12) == 12 and _boundary(b, 12) == 12


def test_a_second_phalanx_in_the_same_processes_agrees_afresh():
    """A notebook's second Phalanx() after the first stopped: same store, same attempt. It read the
    first one's agreement (the request, a count already complete, the old steps): without a signal
    it stopped at once, and with one a rank decided its stop before the other had posted, on a
    step the other did not choose (the ranks then wait in different collectives: the hang)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    a, b = _rank(server, 0, 2), _rank(client, 1, 2)
    a.request("SIGTERM")
    assert _boundary(a, 10) is None
    b.poll(b._store)
    assert _boundary(b, 10) is None and b.stop_at == 11
    assert _boundary(a, 11) == 11 and _boundary(b, 11) == 11  # the first Phalanx() stopped after step 11
    # each rank's second Phalanx() (as preemption.start numbers them), on the same store
    a, b = _rank(server, 0, 2, generation=1), _rank(client, 1, 2, generation=1)
    b.poll(b._store)
    assert b.requested is None  # no signal yet: nothing to stop for
    a.request("SIGTERM")
    assert _boundary(a, 1) is None and a.stop_at is None  # posted 1; rank 1 has not posted: not decided
    b.poll(b._store)
    assert _boundary(b, 2) is None and b.stop_at == 3
    assert _boundary(a, 2) is None and a.stop_at == 3
    assert _boundary(a, 3) == 3 and _boundary(b, 3) == 3


def test_preemption_start_numbers_the_phalanx_objects_of_a_process(tmp_path):
    checkpointer = SimpleNamespace(global_step=0, directory=tmp_path, step_listeners=[])
    started = [
        preemption.start(
            signals="SIGUSR2",
            checkpointer=checkpointer,
            rank=0,
            world_size=1,
            progress=StepTracker(),
            cycle_idle=lambda: True,
            busy=None,
            grace=1.0,
        )
        for _ in range(2)
    ]
    try:
        assert started[0]._prefix != started[1]._prefix
        assert started[1]._prefix.startswith(started[0]._prefix.rsplit("/", 1)[0] + "/")
    finally:
        for p in started:
            p.close()


def test_a_world_of_one_stops_at_its_next_boundary():
    p = _rank(None, 0, 1)  # type: ignore[arg-type]
    p.request("SIGUSR1")
    assert _boundary(p, 4) == 4


def test_inside_an_accumulation_cycle_there_is_no_boundary():
    p = _rank(None, 0, 1)  # type: ignore[arg-type]
    idle = [False]
    p.cycle_idle = lambda: idle[0]
    p.request("SIGTERM")
    assert _boundary(p, 4) is None
    idle[0] = True
    assert _boundary(p, 5) == 5


def test_signal_deliveries_are_counted_from_a_thread_and_close_ones_count_once():
    seen: list[tuple[int, int]] = []
    watch = SignalWatch((signal.SIGUSR2,), lambda signum, count: seen.append((signum, count)), same_delivery_s=0.5)
    assert watch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)  # the same delivery (SLURM and the launcher both send)
        time.sleep(0.7)
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        watch.uninstall()
    assert seen == [(signal.SIGUSR2, 1), (signal.SIGUSR2, 2)]
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


class _SignalInside:
    """A lock that, once held, runs the watch's handler as the interpreter does when a signal arrives
    between two bytecodes of the `with` block: a second delivery on the main thread."""

    def __init__(self, watch: SignalWatch, lock: Any):
        self.watch, self.lock, self.fired = watch, lock, False

    def __enter__(self) -> None:
        self.lock.acquire()
        if not self.fired:
            self.fired = True
            self.watch._handler(signal.SIGUSR2, None)

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()


def test_a_delivery_inside_the_handlers_own_count_does_not_deadlock():
    """Where the handlers count (someone else's wakeup fd: a notebook's event loop), a second signal
    whose handler ran inside the first one's locked count waited for the lock its own thread held."""
    seen: list[int] = []
    watch = SignalWatch((signal.SIGUSR2,), lambda signum, count: seen.append(count))  # not installed: no pipe
    watch._lock = _SignalInside(watch, watch._lock)
    counting = threading.Thread(target=watch._handler, args=(signal.SIGUSR2, None), daemon=True)
    counting.start()
    counting.join(timeout=30)  # the failure is a deadlock: this bound only ends the test
    assert not counting.is_alive(), "the nested delivery deadlocked on the count's lock"
    assert seen == [1]  # one delivery: the two came within same_delivery_s


def test_the_signal_thread_reads_the_pipe_it_was_given_though_uninstalled_before_it_ran(monkeypatch):
    """A second Phalanx() uninstalls the first watch; a thread that had not yet run its first line
    read the pipe from the watch (None by then) and died, leaving the pipe's read end open."""
    started: list[threading.Thread] = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))  # not running yet
    watch = SignalWatch((signal.SIGUSR2,), lambda signum, count: None)
    assert watch.install()
    watch.uninstall()
    monkeypatch.undo()
    (thread,) = started
    read_end = thread._args[0]
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed by the thread at end-of-file


def test_slurm_end_time_from_the_environment_or_squeue():
    assert slurm_job.end_time({"SLURM_JOB_END_TIME": "2000000000"}) == 2000000000.0
    assert slurm_job.end_time({}) is None
    assert slurm_job.parse_end_time("UNLIMITED") is None
    assert slurm_job.parse_end_time("2031-05-04T12:00:00") == time.mktime((2031, 5, 4, 12, 0, 0, 0, 0, -1))
    with pytest.raises(ValueError, match="cannot read SLURM's end time 'soon'"):
        slurm_job.parse_end_time("soon")


@pytest.mark.parametrize(
    "setting, env, checkpoint_dir, wanted",
    [
        ("auto", {"SLURM_JOB_ID": "7"}, "ckpt", True),
        ("auto", {"SLURM_JOB_ID": "7"}, None, False),
        ("auto", {}, "ckpt", False),
        ("on", {"SLURM_JOB_ID": "7"}, None, True),
        ("off", {"SLURM_JOB_ID": "7"}, "c", False),
    ],
)
def test_requeue_is_on_under_slurm_with_checkpoints(setting, env, checkpoint_dir, wanted):
    assert slurm_job.requeue_wanted(setting, env, checkpoint_dir) is wanted
