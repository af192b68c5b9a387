"""`phalanx slurm`: write (or submit, or print) an sbatch script that runs a script under phalanx.

phalanx slurm --nodes 2 --gpus-per-node 4 --time 02:00:00 --partition gpu train.py --lr 3e-4
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from phalanx import config
from phalanx.config import kinds
from phalanx.cluster.slurm_script import SlurmJobSpec, render_script

PROG_ERROR = "phalanx slurm: error:"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    parser.usage = "%(prog)s [options] SCRIPT [ARGS...]"
    add = parser.add_argument
    add("--nodes", type=int, default=1, help="nodes to allocate (one `phalanx run` each)")
    add("--gpus-per-node", type=int, default=0, help="GPUs per node (= workers per node); 0: CPU job")
    add("--time", default="01:00:00", help="time limit, e.g. 02:00:00")
    add("--partition", default=None, help="SLURM partition")
    add("--account", default=None, help="SLURM account")
    add("--cpus-per-task", type=int, default=None, help="CPU cores per node for the job")
    add("--job-name", default=None, help="job name (default: the script's name)")
    add("--log-dir", default="logs", help="directory for the per-node logs, relative to the working directory")
    add("-o", "--output", default=None, help="where to write the script (default: JOB_NAME.sbatch)")
    add("--python", default=sys.executable, help="interpreter on the compute nodes (default: this one)")
    add("--max-restarts", type=int, default=None, help="passed to phalanx run")
    for setting in config.RUNTIME:  # every runtime setting, passed on to `phalanx run` (checked here first)
        add(
            *setting.flags,
            dest=setting.name,
            default=None,
            help=f"passed to phalanx run ({setting.help})".replace("%", "%%"),
        )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    mode.add_argument("--submit", action="store_true", help="write the script and submit it with sbatch")
    add("target", metavar="SCRIPT", help="training script")
    add("target_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script untouched")


def job_spec_from_args(args: argparse.Namespace) -> SlurmJobSpec:
    if not os.path.isfile(args.target):
        raise ValueError(f"training script {args.target!r} not found (working directory: {os.getcwd()})")
    run_flags: list[str] = []
    given = {s.name: getattr(args, s.name) for s in config.RUNTIME}
    config.from_flags(given)  # a bad value fails here, not on the compute nodes
    for setting in config.RUNTIME:
        if given[setting.name] is not None:
            run_flags += [setting.flag, given[setting.name]]
    if args.max_restarts is not None:
        run_flags += ["--max-restarts", str(args.max_restarts)]
    name = args.job_name or os.path.splitext(os.path.basename(args.target))[0]
    settings = config.resolve(config.from_flags(given), warn=False).config
    signals = [s.name.removeprefix("SIG") for s in kinds.signal_numbers(settings.preemption_signals)]
    # USR1 where phalanx handles it (SIGTERM is also what scancel sends); else whatever it handles
    slurm_signal = (
        "USR1" if "USR1" in signals else next((s for s in signals if s != "TERM"), signals[0] if signals else None)
    )
    return SlurmJobSpec(
        target=os.path.abspath(args.target),
        target_args=tuple(args.target_args),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        cpus_per_task=args.cpus_per_task,
        job_name=name,
        workdir=os.getcwd(),
        log_dir=args.log_dir,
        python=args.python,
        run_flags=tuple(run_flags),
        signal=slurm_signal,
        grace=max(1, round(settings.preempt_grace)),
        requeue=settings.requeue != "off",
    )


def main(args: argparse.Namespace) -> int:
    try:
        spec = job_spec_from_args(args)
        text = render_script(spec)
    except ValueError as error:
        print(f"{PROG_ERROR} {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    path = args.output or f"{spec.job_name}.sbatch"
    with open(path, "w") as handle:
        handle.write(text)
    # SLURM opens the batch log (--output) before the script runs: its directory must exist already.
    os.makedirs(os.path.join(spec.workdir, spec.log_dir), exist_ok=True)
    if not args.submit:
        print(f"phalanx slurm: wrote {path}; submit with: sbatch {path}")
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(
            f"{PROG_ERROR} sbatch not found on PATH; the script is in {path}. "
            "HINT: run this on a SLURM login node, or copy the script there and run `sbatch` yourself.",
            file=sys.stderr,
        )
        return 1
    submitted = subprocess.run([sbatch, path], capture_output=True, text=True)
    sys.stdout.write(submitted.stdout)
    sys.stderr.write(submitted.stderr)
    return submitted.returncode
