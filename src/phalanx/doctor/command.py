"""`phalanx doctor [--json]`: run every check, print the report, exit 1 if a launch would break."""

from __future__ import annotations

import argparse
import os
import sys

from phalanx import envvars

DEFAULT_PORT = 29500  # torchrun's default master port


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--json", action="store_true", help="print the report as JSON")
    add(
        "--master-addr",
        default=None,
        help="check resolution and the interface used to reach it (default: $MASTER_ADDR, or SLURM's first host)",
    )
    add(
        "--port",
        type=int,
        action="append",
        default=None,
        metavar="PORT",
        help="a port the launch will use (repeatable; default: $MASTER_PORT); failing if busy",
    )
    add("--nproc", type=int, default=2, help="processes in the live all-reduce (default 2)")
    add("--size-mb", type=float, default=16.0, help="all-reduce message size in MiB")
    add("--timeout", type=float, default=60.0, help="seconds before the all-reduce counts as hung")
    add("--no-allreduce", action="store_true", help="skip the live all-reduce")


def collect(args: argparse.Namespace, env: dict[str, str]) -> list:
    """Every check's findings, in report order."""
    from phalanx.cluster import slurm
    from phalanx.doctor import checks
    from phalanx.doctor.allreduce import run_allreduce

    import torch

    findings = []
    findings += checks.check_versions()
    num_visible = torch.cuda.device_count()
    findings += checks.check_gpus(env, num_visible, checks.physical_gpu_count())
    required = set(args.port or ([int(env[envvars.MASTER_PORT])] if env.get(envvars.MASTER_PORT) else []))
    findings += checks.check_ports(sorted(required | {DEFAULT_PORT}), required)
    findings += checks.check_hostname()
    master = args.master_addr or env.get(envvars.MASTER_ADDR)
    if not master and slurm.in_slurm(env):
        try:
            master = slurm.read_allocation(env).master_addr
        except slurm.SlurmError:
            master = None  # reported by check_slurm below
    findings += checks.check_master(master, env)
    findings += checks.check_shm()
    findings += checks.check_open_files()
    findings += checks.check_slurm(env)
    if not args.no_allreduce:
        gpu_ok = num_visible >= args.nproc and not any(f.check == "gpus" and f.status == "fail" for f in findings)
        findings.append(run_allreduce(args.nproc, args.size_mb, args.timeout, "nccl" if gpu_ok else "gloo"))
    return findings


def main(args: argparse.Namespace) -> int:
    from phalanx.doctor.findings import exit_code, format_json, format_text

    findings = collect(args, dict(os.environ))
    print(format_json(findings) if args.json else format_text(findings))
    sys.stdout.flush()
    return exit_code(findings)
