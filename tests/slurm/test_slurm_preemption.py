"""Preemption under a real (one-node, localhost) SLURM, opt-in like the rest of tests/slurm.

- A batch job written by `phalanx slurm` (with `--signal=USR1@120 --requeue`) gets USR1 mid-training
  (`scancel --signal=USR1`, what SLURM sends ahead of a time limit or a preemption): it saves the
  step, requeues itself, and its next allocation resumes and ends with the uninterrupted run's
  weights, bit for bit.
- Without any --signal, phalanx reads the job's end time and stops preempt_grace seconds before it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
RESUMABLE = ROOT / "tests" / "checkpoint" / "resumable.py"
pytestmark = [pytest.mark.slurm, pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(900)]


def scontrol_show(job_id: str, env: dict) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout


def node_idle(env: dict) -> bool:
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


def wait_until(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_a_preempted_batch_job_saves_requeues_itself_and_resumes_bitwise(slurm_env, tmp_path):
    (tmp_path / "ref").mkdir()
    run_ranks(
        "tests.checkpoint.resumable:run", 2, args=(str(tmp_path / "ref" / "ckpt"), str(tmp_path / "ref")), timeout=200
    )  # the uninterrupted run: REF/final.pt
    job_dir = tmp_path / "job"
    (job_dir / "out").mkdir(parents=True)
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
            "--checkpoint-dir",
            "ckpt",
            "--submit",
            str(RESUMABLE),
            "--out",
            "out",
            "--slow-from",
            "15",
        ],
        cwd=job_dir,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    script = (job_dir / "resumable.sbatch").read_text()
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
    try:
        wait_until(lambda: (job_dir / "out" / "slow").exists(), "the first allocation's slow steps", 300)
        subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm_env, check=True, timeout=30)
        # SLURM holds a requeued job back for a while before it may start again; let it start now.
        wait_until(lambda: "Restarts=1" in scontrol_show(job_id, slurm_env), "the requeue", 120)
        # ... once the first allocation is gone, and not within the second the requeue revoked its job
        # credential: slurmd refuses a launch whose credential is not newer than the revocation
        # ("Killing non-startable batch JobId=N: Job credential revoked", the job FAILED at once).
        # SLURM's own requeue delay (BeginTime) avoids that on a real cluster.
        wait_until(
            lambda: "JobState=PENDING" in scontrol_show(job_id, slurm_env) and node_idle(slurm_env),
            "the first allocation to end",
            120,
        )
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], env=slurm_env, timeout=30)
        wait_until(
            lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)", scontrol_show(job_id, slurm_env)),
            "the requeued job to end",
            400,
        )
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env, timeout=30)
    shown = scontrol_show(job_id, slurm_env)
    node_log = (job_dir / "logs" / f"resumable-{job_id}-node0.out").read_text()
    assert "JobState=COMPLETED" in shown, shown + node_log[-4000:]
    line = re.search(
        r"phalanx: preempted by SIGUSR1 at step (\d+): checkpoint (\S+) saved; "
        rf"requeueing SLURM job {job_id}: its next allocation resumes from it",
        node_log,
    )
    assert line, node_log[-4000:]
    step = int(line.group(1))
    assert Path(line.group(2)) == job_dir / "ckpt" / f"step-{step:08d}"
    events = [json.loads(x) for x in (job_dir / "out" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] != "step"] == [("started", 0), ("resumed", step)]
    expected = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    final = torch.load(job_dir / "out" / "final.pt", weights_only=True)
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


def test_without_a_signal_the_job_saves_preempt_grace_seconds_before_its_end_time(slurm_env, tmp_path):
    """A 4-minute job with preempt_grace 200 s: the workers stop about 40 s in, by themselves."""
    (tmp_path / "out").mkdir()
    proc = subprocess.run(
        [
            "srun",
            "-N1",
            "--ntasks-per-node=1",
            "--time=4",
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--checkpoint-dir",
            "ckpt",
            "--preempt-grace",
            "200",
            "--requeue",
            "off",
            str(RESUMABLE),
            "--out",
            "out",
            "--steps",
            "1000",
            "--slow-from",
            "1",
        ],
        cwd=tmp_path,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 138, proc.stderr[-4000:]
    line = re.search(
        r"phalanx: preempted by SIGUSR1 \(the SLURM job's time limit is 200 s away\) at step (\d+): "
        r"checkpoint (\S+) saved; run the same command to resume",
        proc.stderr,
    )
    assert line, proc.stderr[-4000:]
    step = int(line.group(1))
    assert 1 <= step < 1000
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{step:08d}"
