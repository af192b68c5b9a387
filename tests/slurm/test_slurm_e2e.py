"""End to end under a real (one-node, localhost) SLURM: `phalanx slurm --submit`, `srun python`.

Opt-in (PHALANX_TEST_SLURM=1): it starts munged, slurmctld and slurmd as root from
tests/slurm/local_slurm.sh and stops them afterwards. Needs Debian's slurmctld, slurmd,
slurm-client and munge (`scripts/ci-slurm-deps`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "wine.py"
LOCAL_SLURM = Path(__file__).parent / "local_slurm.sh"
JOB_TIMEOUT_S = 240
pytestmark = [pytest.mark.slurm, pytest.mark.dist, pytest.mark.timeout(600)]


def _why_not() -> str | None:
    if os.environ.get("PHALANX_TEST_SLURM") != "1":
        return "opt-in: set PHALANX_TEST_SLURM=1 (starts SLURM daemons on localhost as root)"
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged here needs root"
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol") if shutil.which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (run scripts/ci-slurm-deps)"
    return None


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run([str(LOCAL_SLURM), "start", str(state)], capture_output=True, text=True, timeout=60)
    try:
        assert started.returncode == 0, started.stderr
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "PHALANX_"))}
        env["SLURM_CONF"] = str(state / "slurm.conf")
        yield env
    finally:
        subprocess.run([str(LOCAL_SLURM), "stop", str(state)], timeout=30)


def _wait_for_job(job_id: str, env: dict) -> str:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\w+)", shown)
        if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state.group(1)
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=env)
    raise AssertionError(f"SLURM job {job_id} did not finish within {JOB_TIMEOUT_S} s")


def test_phalanx_slurm_submit_trains_wine(slurm_env, tmp_path):
    start = time.monotonic()
    submitted = subprocess.run(
        [sys.executable, "-m", "phalanx", "slurm", "--nodes", "1", "--time", "10", "--submit", str(WINE), "--epochs", "3"],
        cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    state = _wait_for_job(job_id, slurm_env)
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
        cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(2 process(es), strategy ddp)" in proc.stdout
    assert proc.stdout.count("test accuracy") == 1  # printed by rank 0 only


def test_phalanx_run_with_one_task_per_process_is_refused(slurm_env, tmp_path):
    (tmp_path / "noop.py").write_text("")
    proc = subprocess.run(
        ["srun", "-N1", "-n2", "--time=10", sys.executable, "-m", "phalanx", "run", "noop.py"],
        cwd=tmp_path, env=slurm_env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("phalanx run: error: SLURM started 2 tasks on this node") == 2
