"""A running SLURM job's time limit and requeueing it: the two questions preemption asks SLURM.

`end_time` reads when the job will be stopped (SLURM_JOB_END_TIME where SLURM exports it, else one
`squeue` call), so a job without `--signal` can still save `preempt_grace` seconds before it.
`requeue` puts a preempted job back in the queue once its checkpoint is saved; its next allocation
runs the same batch script, which resumes from that checkpoint. No torch here.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from typing import Callable, Mapping

from phalanx import envvars

SLURM_JOB_END_TIME = "SLURM_JOB_END_TIME"  # unix seconds; exported by recent SLURM versions only
_NO_LIMIT = ("", "N/A", "NONE", "UNLIMITED", "UNKNOWN", "INVALID")
_Run = Callable[..., subprocess.CompletedProcess]


def job_id(env: Mapping[str, str]) -> str | None:
    """This process's SLURM job id, or None outside SLURM."""
    value = env.get(envvars.SLURM_JOB_ID, "").strip()
    return value or None


def parse_end_time(text: str) -> float | None:
    """squeue's %e ('2031-05-04T12:00:00', local time) -> unix seconds; None for no limit."""
    text = text.strip()
    if text.upper() in _NO_LIMIT:
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        raise ValueError(f"cannot read SLURM's end time {text!r} (expected YYYY-MM-DDTHH:MM:SS)") from None


def end_time(env: Mapping[str, str], run: _Run = subprocess.run) -> float | None:
    """When SLURM will stop this job (unix seconds), or None: no job, no limit, or squeue unavailable."""
    exported = env.get(SLURM_JOB_END_TIME, "").strip()
    if exported.isdigit():
        return float(exported)
    job = job_id(env)
    squeue = shutil.which("squeue")
    if job is None or squeue is None:
        return None
    shown = run([squeue, "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30)
    if shown.returncode != 0 or not shown.stdout.strip():
        return None
    return parse_end_time(shown.stdout.splitlines()[0])


def end_time_here() -> float | None:
    """`end_time` of this process's own environment."""
    return end_time(os.environ)


def requeue(job: str, run: _Run = subprocess.run) -> str | None:
    """`scontrol requeue JOB`; None when it worked, else why not (scontrol's own words)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return "scontrol is not on PATH"
    done = run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip() or f"scontrol exited with {done.returncode}"
    return None


def requeue_wanted(setting: str, env: Mapping[str, str], checkpoint_dir: str | None) -> bool:
    """The `requeue` setting resolved: on only inside a SLURM job; auto = when checkpoints are saved."""
    if setting == "off" or job_id(env) is None:
        return False
    return setting == "on" or bool(checkpoint_dir)
