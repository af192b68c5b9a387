"""Preemption: SIGTERM / SIGUSR1 stop the job after an agreed step with a checkpoint of it, exit
128 + N after one line, and the same command resumes to the uninterrupted run's weights, bit for bit.

Under `phalanx run` (the launcher gets the signal), plain torchrun (each worker gets it directly)
and a world of one (`python train.py`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import read_events
from tests.dist.harness import ROOT, run_command

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

SCRIPT = "tests/checkpoint/resumable.py"
LINE = re.compile(
    r"^phalanx: preempted by (SIG\w+) at step (\d+): checkpoint (\S+) saved; run the same command to resume$"
)


def env() -> dict[str, str]:
    return dict(
        os.environ,
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def phalanx_run(base: Path, *script_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--checkpoint-dir",
        str(base / "ckpt"),
        "--run-dir",
        str(base / "run"),
        SCRIPT,
        "--out",
        str(base / "out"),
        *script_args,
    ]


def signalled(command: list[str], out: Path, send, timeout: float = 240) -> subprocess.CompletedProcess:
    """Start `command`; once the script reached its slow steps (OUT/slow), call `send(proc)`; wait."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while not (out / "slow").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the script never reached its slow steps"
            time.sleep(0.1)
        send(proc)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def preemption_line(stderr: str) -> re.Match:
    lines = [line for line in stderr.splitlines() if line.startswith("phalanx: preempted")]
    assert len(lines) == 1, stderr[-4000:]
    match = LINE.match(lines[0])
    assert match, lines[0]
    return match


def assert_checkpoint_of(match: re.Match, base: Path, events: list[dict]) -> int:
    """The line's checkpoint is the latest, complete, of the step every rank stopped after."""
    step = int(match.group(2))
    path = Path(match.group(3))
    assert path == base / "ckpt" / f"step-{step:08d}"
    assert (base / "ckpt" / "latest").read_text().strip() == path.name
    assert json.loads((path / "manifest.json").read_text())["step"] == step
    assert not list((base / "ckpt").glob(".staging-*"))
    assert max(e["step"] for e in events if e["event"] == "step") == step  # no step after it
    return step


def assert_resumes_bitwise(command: list[str], base: Path, step: int, expected: dict) -> None:
    rerun = run_command(command, env(), timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    events = read_events(base / "out")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [step]
    final = torch.load(base / "out" / "final.pt", weights_only=True)
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_signal_to_phalanx_run_saves_the_step_exits_128_plus_n_and_resumes_bitwise(reference, tmp_path, sig, code):
    command = phalanx_run(tmp_path, "--slow-from", "15")
    proc = signalled(command, tmp_path / "out", lambda p: p.send_signal(sig))
    assert proc.returncode == code, proc.stderr[-4000:]
    match = preemption_line(proc.stderr)
    assert match.group(1) == sig.name
    step = assert_checkpoint_of(match, tmp_path, read_events(tmp_path / "out"))
    assert step >= 15
    assert_resumes_bitwise(phalanx_run(tmp_path), tmp_path, step, reference["final"])


def test_plain_torchrun_workers_signalled_directly_save_and_resume_bitwise(reference, tmp_path):
    """torchrun knows nothing of phalanx: each worker gets SIGTERM itself and rank 0 prints the line."""

    def command(*extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            SCRIPT,
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "out"),
            *extra,
        ]

    def to_each_worker(proc: subprocess.Popen) -> None:
        for rank in (0, 1):
            path = tmp_path / "out" / f"pid-{rank}"
            wait_for(path, proc)
            os.kill(int(path.read_text()), signal.SIGTERM)

    proc = signalled(command("--slow-from", "15"), tmp_path / "out", to_each_worker)
    assert proc.returncode != 0  # torchrun reports its workers' exit code 143 as a failure
    assert "exitcode  : 143" in proc.stderr, proc.stderr[-4000:]
    match = preemption_line(proc.stderr)
    step = assert_checkpoint_of(match, tmp_path, read_events(tmp_path / "out"))
    assert_resumes_bitwise(command(), tmp_path, step, reference["final"])


def test_world_of_one_python_train_py_on_sigterm(tmp_path):
    """`python train.py` receiving SIGTERM: exit 143, the line, and the rerun ends where an uninterrupted one does."""

    def command(base: Path, *extra: str) -> list[str]:
        return [sys.executable, SCRIPT, "--ckpt", str(base / "ckpt"), "--out", str(base / "out"), *extra]

    (tmp_path / "ref" / "out").mkdir(parents=True)
    ref = run_command(command(tmp_path / "ref"), env(), timeout=240)
    assert ref.returncode == 0, ref.stderr[-4000:]
    base = tmp_path / "stopped"
    proc = signalled(command(base, "--slow-from", "15"), base / "out", lambda p: p.send_signal(signal.SIGTERM))
    assert proc.returncode == 143, proc.stderr[-4000:]
    step = assert_checkpoint_of(preemption_line(proc.stderr), base, read_events(base / "out"))
    assert_resumes_bitwise(
        command(base), base, step, torch.load(tmp_path / "ref" / "out" / "final.pt", weights_only=True)
    )


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        assert proc.poll() is None, f"the script ended ({proc.returncode}) before {path.name} appeared"
        time.sleep(0.05)


def test_a_second_signal_during_the_save_lets_it_finish(tmp_path):
    def send(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        wait_for(tmp_path / "out" / "saving", proc)
        time.sleep(1.2)  # deliveries less than a second apart count as one
        proc.send_signal(signal.SIGTERM)

    command = [
        sys.executable,
        SCRIPT,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "out"),
        "--slow-from",
        "16",
        "--slow-save",
    ]  # a stop at 15 would find its checkpoint saved already
    proc = signalled(command, tmp_path / "out", send)
    assert proc.returncode == 143, proc.stderr[-4000:]
    assert "SIGTERM again; still finishing step and checkpoint" in proc.stderr
    match = preemption_line(proc.stderr)
    assert_checkpoint_of(match, tmp_path, read_events(tmp_path / "out"))
    verify = subprocess.run(
        [sys.executable, "-m", "phalanx", "inspect", "--verify", match.group(3)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0 and "verify: OK" in verify.stdout, verify.stdout + verify.stderr


def test_a_third_signal_exits_at_once_and_the_previous_checkpoint_stays_latest(tmp_path):
    def send(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        wait_for(tmp_path / "out" / "saving", proc)
        for _ in range(2):
            time.sleep(1.2)
            proc.send_signal(signal.SIGTERM)

    command = [
        sys.executable,
        SCRIPT,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "out"),
        "--slow-from",
        "16",
        "--slow-save",
    ]
    proc = signalled(command, tmp_path / "out", send)
    assert proc.returncode == 143, proc.stderr[-4000:]
    assert "third signal (SIGTERM): exiting now" in proc.stderr
    assert "preempted by" not in proc.stderr
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000015"
    verify = subprocess.run(
        [sys.executable, "-m", "phalanx", "inspect", "--verify", str(tmp_path / "ckpt")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verify.returncode == 0 and "step 15" in verify.stdout, verify.stdout + verify.stderr


NO_CHECKPOINTS = """\
import os, sys, time
from pathlib import Path
from phalanx import Phalanx
px = Phalanx()
out = Path(sys.argv[1])
(out / f"pid-{px.rank}").write_text(str(os.getpid()))
px.wait_for_everyone()
if px.is_main_process:
    (out / "slow").write_text("1")
while True:
    time.sleep(0.1)
"""


def test_without_checkpoint_dir_phalanx_run_stops_the_workers_and_says_nothing_was_saved(tmp_path):
    script = tmp_path / "forever.py"
    script.write_text(NO_CHECKPOINTS)
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        str(script),
        str(tmp_path),
    ]
    proc = signalled(command, tmp_path, lambda p: p.send_signal(signal.SIGTERM), timeout=120)
    assert proc.returncode == 143, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("phalanx:")]
    assert lines == [
        "phalanx: preempted by SIGTERM: nothing was saved: no checkpoint_dir is set. HINT: with "
        "--checkpoint-dir DIR (or checkpoint_dir: in the config) the workers save the step they stop at, "
        "and the same command resumes from it"
    ], proc.stderr[-4000:]
    for rank in (0, 1):  # the workers are gone, each ended by the forwarded SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid-{rank}").read_text()), 0)


FINISHED_THEN_HANGS = """\
import atexit, sys, time
from pathlib import Path
from phalanx import Phalanx
px = Phalanx()
px.wait_for_everyone()
out = Path(sys.argv[1])

def hang():  # the script has returned; its process hangs in the interpreter's exit, as gloo's teardown can
    (out / f"exiting-{px.rank}").write_text("1")
    while True:
        time.sleep(0.1)

atexit.register(hang)
"""


def test_a_signal_after_the_script_finished_says_so_not_preempted(tmp_path):
    """A timeout's SIGTERM to a job whose script had returned on every rank (hung in its exit) was
    reported as 'preempted by SIGTERM: nothing was saved'; it now says the script had finished."""
    script = tmp_path / "finished.py"
    script.write_text(FINISHED_THEN_HANGS)
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"exiting-{rank}").exists() for rank in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [line for line in stderr.splitlines() if line.startswith("phalanx:")]
    assert lines == [
        "phalanx: stopped by SIGTERM after the script had finished on every rank (the signal found its "
        "processes exiting, not training): nothing to save, nothing lost"
    ], stderr[-4000:]
    assert proc.returncode == 143
