"""`phalanx parity [--steps K] [run flags] SCRIPT ARGS`: does the script train alike on 1 and N processes?

Runs the unmodified script twice under `phalanx run`: as one process whose prepared loaders take N
times their batch (the global batch), then as N processes. Each run records the loss `px.backward`
receives and the global gradient norm before each of its first K optimizer steps, then stops
(runtime/parity_record.py); dropout is off in both. The table compares them step by step (steps
numbered as `px.global_step` counts them); exit 0 when every step agrees within the tolerance, 1
when one does not (with the first such step and the likely causes), 2 when the runs cannot be
compared (bad flags, a failed run, a script that never calls px.backward or stops before K steps).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from phalanx import config, envvars
from phalanx.launch import devices, run_command
from phalanx.launch.spec import LaunchError
from phalanx.parity import compare

PROG_ERROR = "phalanx parity: error:"
EXIT_DIFFER, EXIT_USAGE = 1, 2
_OWN_FLAGS = ("--steps", "--rtol")
_LOG_TAIL = 40


def configure(parser: argparse.ArgumentParser) -> None:
    """phalanx run's flags, plus --steps and --rtol; the raw arguments are kept to relaunch with."""
    run_command.configure(parser)
    parser.usage = "%(prog)s [--steps K] [--rtol R] [run flags] (SCRIPT | -m MODULE) [ARGS...]"
    parser.description = (
        "Run SCRIPT for K optimizer steps as one process with the global batch (prepared loaders take N x "
        "their batch), then as N processes (phalanx run's flags), and compare each step's loss and gradient "
        "norm; dropout is off in both. Exit 0 when they agree, 1 when they differ (the first step and the "
        "likely causes are named), 2 when they cannot be compared."
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        metavar="K",
        help="optimizer steps to compare (default 3; the first is step 1, as px.global_step counts)",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        metavar="R",
        help=f"a step agrees when |a - b| <= R * |a| + {compare.ATOL:g} for its loss and its "
        "gradient norm (default 1e-4)",
    )
    parse_known = parser.parse_known_args

    def keeping_argv(args: Any = None, namespace: Any = None) -> Any:
        namespace, extras = parse_known(args, namespace)
        namespace.parity_argv = list(sys.argv[2:] if args is None else args)
        return namespace, extras

    parser.parse_known_args = keeping_argv  # type: ignore[method-assign]


def run_args(argv: list[str], num_script_args: int, nproc: int) -> list[str]:
    """`phalanx run` arguments: the user's run flags (without parity's own), --nproc-per-node, the script."""
    script_at = len(argv) - num_script_args - 1
    flags, rest = argv[:script_at], argv[script_at:]
    if flags and flags[-1] in ("-m", "--module"):  # `-m MODULE`: the flag stays with the module
        flags, rest = flags[:-1], [flags[-1], *rest]
    kept, skip = [], False
    for arg in flags:
        if skip:
            skip = False
        elif arg in _OWN_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in _OWN_FLAGS)):
            kept.append(arg)
    return [*kept, "--nproc-per-node", str(nproc), *rest]


def world_size_of(args: argparse.Namespace) -> int:
    """N: the processes `phalanx run` would start with these flags, on one node."""
    spec = run_command.spec_from_args(args)
    if spec.nnodes != 1:
        raise LaunchError(
            f"parity compares runs on this machine; --nnodes {spec.nnodes} is more than one node. "
            "HINT: run it on one node with --nproc-per-node N"
        )
    nproc = devices.resolve_nproc(
        spec.nproc_per_node, spec.gpus, devices.count_visible_gpus, devices.count_cpu_cores(), spec.nproc_kind
    )
    if nproc < 2:
        raise LaunchError(
            f"parity compares 1 process with N >= 2, but the flags give {nproc} process. HINT: --nproc-per-node 2"
        )
    return nproc


def _tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fp:
        return "".join(fp.readlines()[-_LOG_TAIL:])


def main(args: argparse.Namespace) -> int:
    try:
        if args.steps < 1:
            raise LaunchError(f"--steps {args.steps}: compare at least 1 optimizer step")
        if not args.rtol > 0:
            raise LaunchError(f"--rtol {args.rtol}: the tolerance must be positive")
        nproc = world_size_of(args)
    except LaunchError as error:
        print(f"{PROG_ERROR} {error}", file=sys.stderr)
        return EXIT_USAGE
    from phalanx.logging.run_dir import DEFAULT_ROOT, make_unique_dir

    folder = make_unique_dir(os.path.join(DEFAULT_ROOT, "parity"))
    script = args.target
    print(
        f"phalanx parity: {script}, {args.steps} optimizer step(s): 1 process with the global batch "
        f"(prepared loaders take {nproc} x their batch), then {nproc} processes; records and logs in {folder}",
        flush=True,
    )
    print("dropout is taken out of the comparison: it acts as the identity in both runs", flush=True)
    runs = {}
    for label, procs, scale in (("one", 1, nproc), ("many", nproc, 1)):
        code, record, log = _launch(args, label, procs, folder, scale)
        if code != 0:
            print(
                f"{PROG_ERROR} the {procs}-process run of {script} failed (exit {code}); the end of its log "
                f"({log}):\n{_tail(log)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        runs[label] = compare.read_records(record)
        problem = compare.shortfall(runs[label], args.steps, script)
        if problem:
            print(f"{PROG_ERROR} {problem}", file=sys.stderr)
            return EXIT_USAGE
    one, many = runs["one"].steps[: args.steps], runs["many"].steps[: args.steps]
    print(compare.table(one, many, nproc, args.rtol))
    print(
        f"tolerance: a step agrees when |a - b| <= {args.rtol:g} * |a| + {compare.ATOL:g} for its loss and its "
        "gradient norm (--rtol)"
    )
    bad = compare.first_difference(one, many, args.rtol)
    if bad is None:
        print(f"agree: 1 process and {nproc} processes train alike for {args.steps} step(s)")
        return 0
    print(
        f"differ: first at step {one[bad]['step']} (loss {one[bad]['loss']:.8g} vs {many[bad]['loss']:.8g}, "
        f"gradient norm {one[bad]['grad_norm']:.8g} vs {many[bad]['grad_norm']:.8g})"
    )
    causes = compare.likely_causes(one[bad], many[bad], many)
    if causes:
        print("likely causes:")
        for cause in causes:
            print(f"  - {cause}")
    else:
        print(
            "likely causes: none that phalanx can see (BatchNorm, a loss scaled by the world size, an "
            "unprepared loader, per-rank seeds are ruled out); look for code that depends on px.rank or "
            "px.world_size"
        )
    return EXIT_DIFFER


def _launch(args: argparse.Namespace, label: str, nproc: int, folder: str, scale: int) -> tuple[int, str, str]:
    record, log = os.path.join(folder, f"{label}.jsonl"), os.path.join(folder, f"{label}.log")
    env = {
        **os.environ,
        envvars.PHALANX_PARITY_RECORD: record,
        envvars.PHALANX_PARITY_STEPS: str(args.steps),
        envvars.PHALANX_PARITY_BATCH_SCALE: str(scale),
        config.BY_NAME["run_dir"].env or "": os.path.join(folder, label),
    }
    argv = run_args(args.parity_argv, len(args.target_args), nproc)
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.call(
            [sys.executable, "-m", "phalanx", "run", *argv], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return code, record, log
