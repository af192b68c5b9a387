"""A finished job ends in every start method, never waiting on the interpreter's teardown.

Under `--start-method spawn` a script that leaves its gloo process group to the interpreter's
finalization (Accelerate's, many torch scripts) could hang there after its last step (gloo's
`~AsyncAllgatherWork` waiting on the interpreter lock; torchrun hangs the same way), and the
timeout that finally stopped it printed "preempted by SIGTERM: nothing was saved". The spawned
worker now ends as a forked one does: exit handlers, flushed output, then os._exit (under
`--run-path`, where torch's agent runs the script as a function, once its wrapper is done). A job a
timeout stops after its last step says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.dist.harness import ROOT

SCRIPT = Path(__file__).parent / "scripts" / "teardown_waits.py"
pytestmark = [pytest.mark.dist]


def _launch(
    tmp_path: Path, start_method: str, *script_args: str, flags: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, list[tuple[float, str]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--nproc-per-node",
            "2",
            "--start-method",
            start_method,
            "--run-dir",
            str(tmp_path / "run"),
            *flags,
            str(SCRIPT),
            *script_args,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # a hung job is killed whole, workers included
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def _done(lines: list[tuple[float, str]]) -> float | None:
    times = [at for at, line in lines if line.startswith("DONE")]
    return max(times) if len(times) == 2 else None


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        if proc.stdout is not None:
            time.sleep(0.5)  # the reader thread takes the last lines
            proc.stdout.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "start_method, flags",
    [("spawn", ()), ("fork", ()), ("spawn", ("--run-path",))],
    ids=["spawn", "fork", "spawn-run-path"],
)
def test_a_finished_job_never_waits_on_the_interpreter_s_teardown(start_method, flags, tmp_path):
    proc, lines = _launch(tmp_path, start_method, flags=flags)
    code = _wait(proc, timeout=90)  # before: held for the 180 s of the teardown, under spawn
    ended = time.monotonic()
    text = "\n".join(line for _, line in lines)
    assert code == 0, text[-3000:]
    done = _done(lines)
    assert done is not None and ended - done < 30, text[-3000:]


@pytest.mark.timeout(240)
def test_a_script_s_exit_code_under_run_path_ends_its_rank_with_that_code_and_no_teardown(tmp_path):
    """--run-path runs the script in torch's function entrypoint: the worker ends at multiprocessing's
    threading shutdown, with the status it would have had (the script's sys.exit code)."""
    proc, lines = _launch(tmp_path, "spawn", "--exit", "3", flags=("--run-path",))
    code = _wait(proc, timeout=90)
    text = "\n".join(line for _, line in lines)
    assert code == 3 and _done(lines) is not None, text[-3000:]
    assert "rank 1" in text and "exit code 3" in text, text[-3000:]


@pytest.mark.timeout(240)
def test_a_timeout_after_the_last_step_says_the_script_had_finished(tmp_path):
    proc, lines = _launch(tmp_path, "spawn", "--linger", "120")
    deadline = time.monotonic() + 150
    while _done(lines) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "\n".join(line for _, line in lines)[-3000:]
        time.sleep(0.1)
    notes = [tmp_path / "run" / "logs" / "workers" / f"rank{rank}.json" for rank in (0, 1)]
    while not all(note.is_file() and '"finished": true' in note.read_text() for note in notes):
        # each rank's note at its script's end (launch/worker_notes.py), written after its last line: a
        # second's sleep let a loaded machine's SIGTERM land before it, a stop while the script still ran
        assert proc.poll() is None and time.monotonic() < deadline, "\n".join(line for _, line in lines)[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # into the exit handler
    proc.send_signal(signal.SIGTERM)  # as `timeout` would
    code = _wait(proc, timeout=60)
    text = "\n".join(line for _, line in lines)
    assert code == 143, text[-3000:]
    assert (
        "phalanx: stopped by SIGTERM after the script had finished on every rank (the signal found its "
        "processes exiting, not training): nothing to save, nothing lost"
    ) in text, text[-3000:]
    assert "preempted" not in text and "nothing was saved" not in text
