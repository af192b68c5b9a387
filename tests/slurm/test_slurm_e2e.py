"""End to end under a real (one-node, localhost) SLURM: `phalanx slurm --submit`, `srun python`.

Opt-in (PHALANX_TEST_SLURM=1): it starts munged, slurmctld and slurmd as root from
tests/slurm/local_slurm.sh and stops them afterwards. Needs Debian's slurmctld, slurmd,
slurm-client and munge (`scripts/ci-slurm-deps`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import JOB_TIMEOUT_S, wait_for_job

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "wine.py"
pytestmark = [pytest.mark.slurm, pytest.mark.dist, pytest.mark.timeout(600)]


def test_phalanx_slurm_submit_trains_wine(slurm_env, tmp_path):
    start = time.monotonic()
    submitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx",
            "slurm",
            "--nodes",
            "1",
            "--time",
            "10",
            "--submit",
            str(WINE),
            "--epochs",
            "3",
        ],
        cwd=tmp_path,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    state = wait_for_job(job_id, slurm_env)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*")}
    assert state == "COMPLETED", logs
    node_log = (tmp_path / "logs" / f"wine-{job_id}-node0.out").read_text()
    batch_log = (tmp_path / "logs" / f"wine-{job_id}.out").read_text()
    print(f"slurm e2e: job {job_id} in {time.monotonic() - start:.1f} s")
    assert f"job {job_id} on" in batch_log
    assert f"phalanx: SLURM job {job_id}: node 0 of 1, master" in node_log
    assert "(2 process(es), strategy ddp)" in node_log  # CPU node: phalanx run's default of 2 workers


def test_srun_python_one_task_per_process_uses_slurm_ranks(slurm_env, tmp_path):
    """No launcher: the runtime maps SLURM_PROCID/LOCALID/STEP_NUM_TASKS to rank/local rank/world size."""
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "--time=10", sys.executable, str(WINE), "--epochs", "3"],
        cwd=tmp_path,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(2 process(es), strategy ddp)" in proc.stdout
    assert proc.stdout.count("test accuracy") == 1  # printed by rank 0 only


def test_phalanx_run_with_one_task_per_process_is_refused(slurm_env, tmp_path):
    (tmp_path / "noop.py").write_text("")
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "--time=10", sys.executable, "-m", "phalanx", "run", "noop.py"],
        cwd=tmp_path,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("phalanx run: error: SLURM started 2 tasks on this node") == 2
