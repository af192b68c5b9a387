"""The sbatch script `phalanx slurm` writes: one `phalanx run` per node, logs per node.

Why this shape: `phalanx run` starts the workers itself and reads nnodes, node rank, master
address and port from SLURM, so SLURM must start exactly one task per node
(`--ntasks-per-node=1`); starting one task per GPU would multiply the workers.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclasses.dataclass(frozen=True)
class SlurmJobSpec:
    """What the batch script asks SLURM for and what it runs."""

    target: str
    """Training script, absolute path."""
    target_args: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 0
    """0: a CPU job (no GPU request; phalanx run picks its CPU default)."""
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    job_name: str = "phalanx"
    workdir: str = "."
    """Absolute directory the job runs in (logs are relative to it)."""
    log_dir: str = "logs"
    python: str = "python3"
    """Interpreter with phalanx installed, as seen from the compute nodes."""
    run_flags: tuple[str, ...] = ()
    """Extra `phalanx run` flags, e.g. ("--strategy", "zero3")."""
    signal: str | None = "USR1"
    """Signal SLURM sends `grace` seconds before the time limit (`--signal`); None: none asked for."""
    grace: int = 120
    """Seconds before the time limit for `signal` (phalanx's preempt_grace)."""
    requeue: bool = True
    """`--requeue`: a preempted job may put itself back in the queue (phalanx run does, once saved)."""


def check_job_spec(spec: SlurmJobSpec) -> SlurmJobSpec:
    """Refuse values sbatch would reject later (or, worse, accept and misread)."""
    if spec.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {spec.nodes}")
    if spec.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {spec.gpus_per_node}")
    if not _TIME.match(spec.time):
        raise ValueError(
            f"--time {spec.time!r} is not a SLURM time. HINT: MINUTES, HH:MM:SS or DAYS-HH:MM:SS, e.g. 02:00:00"
        )
    if not 0 < spec.grace <= 65535:
        raise ValueError(f"--preempt-grace {spec.grace}: SLURM's --signal takes 1..65535 seconds")
    if not re.fullmatch(r"[\w.+-]+", spec.job_name):
        raise ValueError(f"--job-name {spec.job_name!r}: use letters, digits, '.', '_', '+', '-' only")
    return spec


def render_script(spec: SlurmJobSpec) -> str:
    """The sbatch script text."""
    check_job_spec(spec)
    q = shlex.quote
    directives = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        f"--time={spec.time}",
        f"--chdir={spec.workdir}",
        f"--output={spec.log_dir}/%x-%j.out",
    ]
    if spec.gpus_per_node:
        directives.insert(3, f"--gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        directives.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.partition:
        directives.append(f"--partition={spec.partition}")
    if spec.account:
        directives.append(f"--account={spec.account}")
    if spec.signal:  # phalanx run saves a checkpoint on it and stops in time
        directives.append(f"--signal={spec.signal}@{spec.grace}")
    if spec.requeue:  # a requeued run appends to its logs instead of overwriting them
        directives += ["--requeue", "--open-mode=append"]
    nproc = str(spec.gpus_per_node) if spec.gpus_per_node else "auto"
    run = [
        spec.python,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        nproc,
        *spec.run_flags,
        spec.target,
        *spec.target_args,
    ]
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {d}" for d in directives]
    lines += [
        "# Written by `phalanx slurm`. One task per node runs `phalanx run`, which reads the node count,",
        "# this node's rank, the master address (first host) and a port derived from the job id from",
        "# SLURM, and starts one worker per GPU. Each node logs to its own file: "
        f"{spec.log_dir}/<job>-<id>-node<N>.out",
        "set -euo pipefail",
        f"mkdir -p {q(spec.log_dir)}",
        f'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: {spec.nodes} node(s) x {nproc} process(es)"',
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1" + (" --open-mode=append" if spec.requeue else "") + " \\",
        f"  --output={q(spec.log_dir)}/%x-%j-node%n.out \\",
        "  " + " ".join(q(part) for part in run),
    ]
    return "\n".join(lines) + "\n"
