"""A save that hits a full disk stops the job with one message on every rank, removes its staging
directory and leaves `latest` on the previous good checkpoint; a checkpoint_dir that cannot be
written is refused before training starts.

The full disk is a real one: a 2 MiB tmpfs mounted as checkpoint_dir (needs root), filled by the
script after its step-10 checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.checkpoint.conftest import read_events
from tests.dist.harness import ROOT, RanksFailed, run_command, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _bytes_in(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.iterdir() if path.is_file())


def _why_no_tmpfs() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small tmpfs as a full disk needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount not installed"
    return None


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m", options: str = "") -> Iterator[Path]:
    reason = _why_no_tmpfs()
    if reason:
        pytest.skip(reason)
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_stops_every_rank_with_one_message_and_keeps_latest(tmp_path, async_save):
    out = tmp_path / "out"
    out.mkdir()
    with small_tmpfs(tmp_path / "ckpt") as ckpt:
        args = (str(ckpt), str(out), 40, 5, 12, "", async_save, 0, True, None, False, 10)
        with pytest.raises(RanksFailed) as failed:
            run_ranks("tests.checkpoint.resumable:run", 2, args=args, timeout=200)
        logs = str(failed.value).split("--- rank ")[1:]
        assert len(logs) == 2
        for log in logs:  # every rank stops with the same message: path, error, latest good step
            assert f"CheckpointWriteError: saving checkpoint step 15 to {ckpt}/step-00000015 failed on rank" in log
            assert "No space left on device" in log
            full = re.search(
                rf"the filesystem of the checkpoint directory {re.escape(str(ckpt))} is full: the checkpoint "
                r"needs about (\d+) bytes \([^)]*\), (\d+) bytes are free",
                log,
            )
            assert full, log[-3000:]
            needed, free = int(full.group(1)), int(full.group(2))
            written = _bytes_in(ckpt / "step-00000010")  # 145 KB; the message said 6940 bytes before
            assert written / 2 <= needed <= written * 2 and free < needed, (needed, written)
            assert f"the latest good checkpoint is step 10 ({ckpt}/step-00000010)" in log
            message = log[log.index("CheckpointWriteError: saving") :].splitlines()[0]
            assert message.endswith(
                "HINT: free space there, lower checkpoint_keep, or point checkpoint_dir at a larger filesystem, "
                "then save again"
            ), message
            assert "The above exception was the direct cause" not in log, "one phalanx message, no torch frames"
        assert (ckpt / "latest").read_text().strip() == "step-00000010"
        assert not list(ckpt.glob(".staging-*")) and not (ckpt / "step-00000015").exists()
        assert max(e["step"] for e in read_events(out) if e["event"] == "step") == 15  # no step after the failure
        (ckpt / "filler").unlink()  # not needed to verify, but leaves the mount as a user would clean it
        verify = subprocess.run(
            [sys.executable, "-m", "phalanx", "inspect", "--verify", str(ckpt)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert verify.returncode == 0 and "verify: OK" in verify.stdout, verify.stdout + verify.stderr
        assert "step 10" in verify.stdout


def test_a_full_disk_under_phalanx_run_is_not_restarted(tmp_path):
    """--max-restarts would only fill the disk again: the job stops, saying why, from the first failure."""
    out = tmp_path / "out"
    out.mkdir()
    with small_tmpfs(tmp_path / "ckpt") as ckpt:
        env = dict(
            os.environ,
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        proc = run_command(
            [
                sys.executable,
                "-m",
                "phalanx",
                "run",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "2",
                "--checkpoint-dir",
                str(ckpt),
                "--run-dir",
                str(tmp_path / "run"),
                "tests/checkpoint/resumable.py",
                "--out",
                str(out),
                "--fill-after",
                "10",
            ],
            env,
            timeout=240,
        )
        assert proc.returncode == 1, proc.stderr[-4000:]
        assert "phalanx: restart" not in proc.stderr
        assert "phalanx: not restarting: a checkpoint could not be written" in proc.stderr
        assert "No space left on device" in proc.stderr and "the latest good checkpoint is step 10" in proc.stderr
        report = proc.stderr[proc.stderr.index("failed with exit code") :]
        assert "site-packages/torch" not in report, report  # the script's frames and one phalanx message
        assert (ckpt / "latest").read_text().strip() == "step-00000010"
        assert not list(ckpt.glob(".staging-*"))


def _run_refused(checkpoint_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script must not start')\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--nproc-per-node",
            "2",
            "--checkpoint-dir",
            str(checkpoint_dir),
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_checkpoint_dir_under_a_file_is_refused_before_launch(tmp_path):
    (tmp_path / "file").write_text("x")
    proc = _run_refused(tmp_path / "file" / "ckpt", tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"phalanx run: error: checkpoint_dir {tmp_path / 'file' / 'ckpt'} cannot be written: ")
    assert "Not a directory" in lines[0] and "HINT:" in lines[0]


def test_a_read_only_checkpoint_dir_is_refused_before_launch_and_by_phalanx(tmp_path):
    with small_tmpfs(tmp_path / "ro", options=",ro") as ro:
        proc = _run_refused(ro, tmp_path)
        assert proc.returncode == 2
        assert "cannot be written: [Errno 30] Read-only file system" in proc.stderr, proc.stderr
        code = (
            "from phalanx import Phalanx\n"
            "try:\n    Phalanx(checkpoint_dir=%r)\nexcept ValueError as e:\n    print(e)\n" % str(ro)
        )
        shown = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert f"checkpoint_dir {ro} cannot be written: [Errno 30] Read-only file system" in shown.stdout, shown.stderr
