"""One job per directory (issue 52): two jobs on one --checkpoint-dir and --run-dir had no lock; the
second resumed the first's checkpoint, then died with `FileExistsError: step-00000010 already exists`,
and metrics.csv held both jobs' rows. Now the second is refused before its workers start, naming the
holder, and a lock left by a SIGKILLed job is taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.logging import dir_lock
from tests.launcher.launch_helpers import SCRIPTS, run_cli

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def job_args(tmp_path: Path) -> list[str]:
    dirs = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run")]
    return ["run", "--nproc-per-node", "1", *dirs, str(SCRIPTS / "hold_dirs.py"), str(tmp_path / "go")]


def start(tmp_path: Path, name: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "phalanx", *job_args(tmp_path)]
    with open(tmp_path / f"{name}.err", "w") as err:  # the child keeps its own copy
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, start_new_session=True)


def test_two_jobs_started_together_one_is_refused_with_the_holder_named(tmp_path):
    jobs = {"a": start(tmp_path, "a"), "b": start(tmp_path, "b")}
    try:
        deadline = time.monotonic() + 90
        while all(job.poll() is None for job in jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = next(name for name, job in jobs.items() if job.poll() is not None)
        winner = "b" if refused == "a" else "a"
        (tmp_path / "go").touch()
        out, _ = jobs[winner].communicate(timeout=90)
    finally:
        for job in jobs.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            if job.stdout is not None:
                job.stdout.close()
    message = (tmp_path / f"{refused}.err").read_text()
    assert jobs[refused].returncode == 2, message
    assert (
        f"phalanx run: error: the run directory (--run-dir) {tmp_path / 'run'} is in use by another job: "
        f"pid {jobs[winner].pid} on host {socket.gethostname()}, started "
    ) in message
    assert "HINT: wait for that job to end (or stop it), or give this job a run directory (--run-dir) of its own" in (
        message
    )
    assert jobs[winner].returncode == 0, (tmp_path / f"{winner}.err").read_text()[-3000:]
    assert "rank 0: started at step 0" in out and "rank 0: finished" in out
    assert not (tmp_path / "ckpt" / dir_lock.LOCK_NAME).exists(), "a job that ended cleanly leaves no lock"
    assert not (tmp_path / "run" / dir_lock.LOCK_NAME).exists()


def test_a_job_after_a_sigkilled_one_takes_its_lock_over_and_resumes(tmp_path):
    killed = start(tmp_path, "killed")
    try:
        for line in killed.stdout:
            if "holding at step 4" in line:
                break
        assert (tmp_path / "ckpt" / dir_lock.LOCK_NAME).exists()
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the launcher and its worker, as the OOM killer or a lost node would
        killed.wait()
        killed.stdout.close()
    (tmp_path / "go").touch()
    result = run_cli(job_args(tmp_path), env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"phalanx: took over the lock of {tmp_path / 'ckpt'} from pid {killed.pid} on host {socket.gethostname()}, "
        "started "
    ) in result.stderr
    assert ", no longer running" in result.stderr
    assert "rank 0: started at step 4" in result.stdout  # it resumed the killed job's checkpoint
