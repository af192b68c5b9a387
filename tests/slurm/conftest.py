"""The local one-node SLURM the opt-in tests share (PHALANX_TEST_SLURM=1): started once per session
from local_slurm.sh as root, stopped afterwards."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

LOCAL_SLURM = Path(__file__).parent / "local_slurm.sh"
JOB_TIMEOUT_S = 240


def why_not() -> str | None:
    if os.environ.get("PHALANX_TEST_SLURM") != "1":
        return "opt-in: set PHALANX_TEST_SLURM=1 (starts SLURM daemons on localhost as root)"
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged here needs root"
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol") if shutil.which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (run scripts/ci-slurm-deps)"
    return None


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory):
    reason = why_not()
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


def wait_for_job(job_id: str, env: dict) -> str:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\w+)", shown)
        if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state.group(1)
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=env)
    raise AssertionError(f"SLURM job {job_id} did not finish within {JOB_TIMEOUT_S} s")
