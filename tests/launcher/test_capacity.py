"""Process counts beyond what the node can run are refused before any worker starts, with the count
that fits; `--allow-oversubscribe` says the count is meant. (Issue 52: `--nproc-per-node 99999` warned,
then tried to start them; in a pids cgroup of 60 it hung with an empty launcher.log.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from phalanx.launch import capacity, devices
from tests.launcher.launch_helpers import RECORD_ENV, run_cli

pytestmark = pytest.mark.timeout(90)

PIDS_ROOT = Path("/sys/fs/cgroup/pids")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def test_more_workers_than_the_cores_can_run_are_refused_with_the_count_that_fits(out_dir):
    cores = devices.count_cpu_cores()
    args = ["run", "--run-dir", str(out_dir.parent / "run"), "--nproc-per-node", "99999", str(RECORD_ENV), str(out_dir)]
    result = run_cli(args, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    fits = cores * capacity.WORKERS_PER_CORE
    assert (
        f"phalanx run: error: --nproc-per-node 99999: this node can run at most {fits} worker(s) "
        f"({capacity.WORKERS_PER_CORE} per core on its {cores} core(s)). HINT: use --nproc-per-node {fits}, "
        "or add --allow-oversubscribe if 99999 is meant"
    ) in result.stderr
    assert "warning" not in result.stderr  # refused, not warned about and then tried
    assert not list(out_dir.iterdir())  # no worker ran


def test_allow_oversubscribe_lifts_the_bound():
    assert capacity.check(99999, 2, None, allowed=True) is None
    assert capacity.check(16, 2, None, allowed=False) is None  # 8 ranks a core still run
    limit = capacity.TaskLimit(60, "the pids cgroup X (pids.max 60, 0 in use)")
    assert "at most 2 worker(s) (about 20 threads each under the pids cgroup X" in capacity.check(3, 2, limit, False)


@pytest.fixture
def pids_cgroup():
    """A pids cgroup of 60 tasks (as root, on the v1 controller); its processes ended and it removed after."""
    where = PIDS_ROOT / f"phalanx-test-{uuid.uuid4().hex[:8]}"
    try:
        where.mkdir()
        (where / "pids.max").write_text("60")
    except OSError as error:
        if where.is_dir():
            where.rmdir()
        pytest.skip(f"no pids cgroup to make here: {error}")
    try:
        yield where
    finally:
        for pid in (where / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):
            try:
                where.rmdir()
                break
            except OSError:
                subprocess.run(["sleep", "0.1"], check=False)


def test_workers_beyond_the_pids_cgroup_are_refused_before_any_starts(pids_cgroup, out_dir, tmp_path):
    enter = f'echo $$ > {pids_cgroup / "cgroup.procs"} && exec "$@"'
    command = [sys.executable, "-m", "phalanx", "run", "--run-dir", str(tmp_path / "run")]
    command += ["--nproc-per-node", "4", str(RECORD_ENV), str(out_dir)]
    proc = subprocess.run(["sh", "-c", enter, "sh", *command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "phalanx run: error: --nproc-per-node 4: this node can run at most 2 worker(s) (about 20 threads " in (
        proc.stderr
    )
    assert f"under the pids cgroup {pids_cgroup} (pids.max 60, " in proc.stderr
    assert "HINT: use --nproc-per-node 2, or add --allow-oversubscribe if 4 is meant" in proc.stderr
    assert not list(out_dir.iterdir())
