"""`phalanx run`'s failure path, black-box: exit codes, the quiet report, restarts spoken aloud."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launcher.launch_helpers import LAUNCH_TIMEOUT_S, SCRIPTS, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# torch's own logging (glog-style "E1123 00:53:28.909000 5609 torch/...") and its agent's traceback
AGENT_LOG_LINE = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/", re.M)


def test_exit_code_is_the_failing_ranks_own():
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "rank1_ends.py"), "3"])
    assert result.returncode == 3, result.stderr[-3000:]
    assert "phalanx: rank 1 (local rank 1 on node 0) failed with exit code 3" in result.stderr


def test_a_rank_killed_by_sigkill_gives_137_as_a_shell_would():
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "rank1_ends.py"), "kill"])
    assert result.returncode == 137, result.stderr[-3000:]
    assert "phalanx: rank 1 (local rank 1 on node 0) was killed by signal SIGKILL" in result.stderr


def test_default_report_has_the_rank_and_traceback_and_no_agent_logging(tmp_path):
    run_dir, temp = tmp_path / "run", tmp_path / "tmp"
    temp.mkdir()
    result = run_cli(
        ["run", "--nproc-per-node", "2", str(SCRIPTS / "fail_rank1.py")],
        env={"PHALANX_RUN_DIR": str(run_dir), "TMPDIR": str(temp)},
    )
    assert result.returncode == 1
    # torch's error pickle of the failed rank (pytorch-errorfile-*) and its log directory went with the launch
    assert sorted(p.name for p in temp.iterdir()) == []
    text = result.stderr
    report = text[text.index("phalanx: rank 1 (local rank 1 on node 0) failed with exit code 1") :]
    assert re.match(
        r"phalanx: rank 1 \(local rank 1 on node 0\) failed with exit code 1\n  on host \S+\n"
        r"Traceback \(most recent call last\):\n",
        report,
    ), report
    assert "RuntimeError: deliberate failure on rank one" in report
    assert f"phalanx: full logs in {run_dir / 'logs'}" in report
    assert not AGENT_LOG_LINE.search(text), text
    assert "torch/distributed/elastic" not in text
    # ... which went to the launcher's log instead
    log = (run_dir / "logs" / "launcher.log").read_text()
    assert "torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1) local_rank: 1" in log


def test_verbose_shows_the_agent_logging_too(tmp_path):
    result = run_cli(
        ["run", "--verbose", "--nproc-per-node", "2", str(SCRIPTS / "fail_rank1.py")],
        env={"PHALANX_RUN_DIR": str(tmp_path / "run")},
    )
    assert result.returncode == 1
    assert AGENT_LOG_LINE.search(result.stderr), result.stderr
    assert "failed (exitcode: 1) local_rank: 1" in result.stderr
    assert "phalanx: rank 1 (local rank 1 on node 0) failed with exit code 1" in result.stderr


def test_restart_after_sigkill_names_the_rank_its_step_and_the_resume_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            str(ckpt),
            str(SCRIPTS / "killed_then_resumed.py"),
            str(tmp_path),
        ],
        env={"PHALANX_RUN_DIR": str(tmp_path / "run"), "PHALANX_WATCHDOG_TIMEOUT": "60"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("phalanx: restart")]
    assert lines == [
        f"phalanx: restart 1 of 1: rank 1 was killed by signal SIGKILL at step 2 of that attempt; "
        f"resuming from checkpoint step 2 ({ckpt / 'step-00000002'})"
    ], result.stderr[-4000:]
    assert (tmp_path / "resumed.txt").read_text().splitlines() == ["0 False 0", "1 True 2"]
    # the start-up line does not pretend auto is a strategy; what it chose is said at prepare
    output = result.stdout + result.stderr
    assert "strategy auto (decided at prepare(model), when the model is known)" in output
    assert re.search(
        r"\[rank 0\] INFO phalanx: strategy auto chose ddp: ddp needs [\d.]+ \w+ per rank, within the "
        r"[\d.]+ \w+ budget",
        output,
    ), output[-3000:]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_ctrl_c_ends_quietly_with_130(tmp_path, start_method):
    """Ctrl-C reaches the launcher and every worker (one process group, as in a terminal)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--start-method",
            start_method,
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "wait_for_ctrl_c.py"),
            str(tmp_path),
        ],
        env={**os.environ, "PHALANX_RUN_DIR": str(tmp_path / "run")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "phalanx: stopped by SIGINT; workers were terminated" in err
