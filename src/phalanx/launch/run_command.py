"""`phalanx run`: torchrun's flags (both spellings) -> `LaunchSpec` -> torch's elastic agent.

`configure` adds the flags, `main` validates everything it can before importing torch, then
launches. Errors print `phalanx run: error: ...` and exit 2, before any worker starts.

To add a phalanx setting that workers read, add a row to PASSTHROUGH_FLAGS (and its variable to
`phalanx.envvars`): the launcher exports it to every worker; the runtime reads it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable

from phalanx import config_command, envvars
from phalanx.config import ConfigError
from phalanx.cluster.launch_plan import CLUSTER_ERRORS, apply_slurm, plan_for
from phalanx.cluster.rendezvous import DEFAULT_RDZV_TIMEOUT_S, parse_nnodes
from phalanx.launch import devices, ports
from phalanx.launch.spec import START_METHODS, LaunchError, LaunchSpec, parse_gpus, parse_nproc_per_node, validate

PROG_ERROR = "phalanx run: error:"
EXIT_USAGE = 2


def _timeout_or_off(text: str) -> str:
    value = float(text)  # argparse turns ValueError into "invalid number of seconds value"
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds (0 turns it off), got {text}")
    return text


def _positive_int(text: str) -> str:
    if int(text) < 1:  # argparse turns ValueError into "invalid count value"
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return text


def _existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"file {text!r} not found")
    return os.path.abspath(text)  # workers may run from another directory


def _absolute_path(text: str) -> str:
    return os.path.abspath(text)  # workers may run from another directory


_timeout_or_off.__name__ = "number of seconds"
_existing_file.__name__ = "file"
_positive_int.__name__ = "count"


@dataclasses.dataclass(frozen=True)
class PassThroughFlag:
    """A phalanx setting the launcher only exports to workers, as `env_var`."""

    flags: tuple[str, ...]
    env_var: str
    help: str
    type: Callable[[str], str] = str


PASSTHROUGH_FLAGS: tuple[PassThroughFlag, ...] = (
    PassThroughFlag(("--strategy",), envvars.PHALANX_STRATEGY, "distribution strategy: dp, ddp, zero1, zero2, zero3 (fsdp), hsdp"),
    PassThroughFlag(("--mixed-precision", "--mixed_precision"), envvars.PHALANX_MIXED_PRECISION, "mixed precision mode, e.g. bf16, fp16, no"),
    PassThroughFlag(("--watchdog-timeout", "--watchdog_timeout"), envvars.PHALANX_WATCHDOG_TIMEOUT, "seconds without progress before the watchdog reports a hang; 0 turns it off", _timeout_or_off),
    PassThroughFlag(("--deepspeed",), envvars.PHALANX_DEEPSPEED_CONFIG, "path of a DeepSpeed JSON config", _existing_file),
    PassThroughFlag(("--checkpoint-dir", "--checkpoint_dir"), envvars.PHALANX_CHECKPOINT_DIR,
                    "checkpoint root: px.save_state()/load_state() with no path use it (with --max-restarts, runs resume by themselves)",
                    _absolute_path),
    PassThroughFlag(("--grad-accum-steps", "--grad_accum_steps"), envvars.PHALANX_GRAD_ACCUM_STEPS,
                    "micro-steps per optimizer step (px.accumulate)", _positive_int),
)


def _dest(flag: PassThroughFlag) -> str:
    return "phalanx_" + flag.flags[0].lstrip("-").replace("-", "_")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `phalanx run`'s flags: torchrun's (both spellings), phalanx's, then SCRIPT ARGS..."""
    parser.allow_abbrev = False  # `--nproc 2` must not silently mean --nproc-per-node
    parser.usage = "%(prog)s [options] (SCRIPT | -m MODULE) [ARGS...]"
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="auto", metavar="N|auto",
        help="workers on this node; auto = one per visible GPU, else %d on CPU" % devices.CPU_DEFAULT_NPROC)
    add("--nnodes", default="1", metavar="N|MIN:MAX",
        help="number of nodes, or an elastic range (c10d); inside SLURM: taken from the allocation")
    add("--node-rank", "--node_rank", type=int, default=0, help="rank of this node (static rendezvous)")
    add("--master-addr", "--master_addr", default=None, help="address of node 0 (default 127.0.0.1 on one node)")
    add("--master-port", "--master_port", type=int, default=None,
        help="port of node 0's store (default on one node: a free port)")
    add("--rdzv-backend", "--rdzv_backend", default="static", help="rendezvous backend: static, c10d, etcd...")
    add("--rdzv-endpoint", "--rdzv_endpoint", default="", help="rendezvous endpoint HOST:PORT")
    add("--rdzv-id", "--rdzv_id", default="", help="job id shared by all nodes")
    add("--rdzv-timeout", "--rdzv_timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S, metavar="SECONDS",
        help="fail with a report of what is missing when the nodes have not all met by then")
    add("--max-restarts", "--max_restarts", type=int, default=0, help="restarts of the worker group on failure")
    add("--gpus", default=None, metavar="I,J,...", help="GPU indices to use; sets CUDA_VISIBLE_DEVICES and the process count")
    add("--start-method", "--start_method", default="auto", choices=START_METHODS,
        help="fork: workers inherit the launcher's torch import (fast); spawn: fresh interpreters "
             "like torchrun; auto: fork unless GPUs are in use")
    for flag in PASSTHROUGH_FLAGS:
        add(*flag.flags, dest=_dest(flag), type=flag.type, default=None, help=f"{flag.help} (exported as {flag.env_var})")
    add("-m", "--module", action="store_true", help="run TARGET as a module, like python -m")
    add("target", metavar="SCRIPT", help="training script (or module with -m)")
    add("target_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script untouched")
    config_command.add_config_flag(parser)  # --config FILE: settings under the flags (file < env < flag)
    _refuse_unknown_flags(parser)


def _refuse_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Report unknown flags before the script as `phalanx run` errors, not the top-level parser's."""
    parse_known = parser.parse_known_args

    def strict_parse_known_args(args=None, namespace=None):  # type: ignore[no-untyped-def]
        namespace, extras = parse_known(args, namespace)
        if extras:
            parser.error(
                f"unrecognized arguments: {' '.join(extras)}. phalanx run's own flags go before "
                "the script; everything after the script name is passed to the script. "
                "HINT: see phalanx run --help"
            )
        return namespace, extras

    parser.parse_known_args = strict_parse_known_args  # type: ignore[method-assign]


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    """Turn parsed flags into a validated spec (pure: no torch, no processes)."""
    try:
        file_env = config_command.apply_config_file(args)
    except ConfigError as error:
        raise LaunchError(str(error)) from None
    worker_env = file_env | {
        flag.env_var: getattr(args, _dest(flag))
        for flag in PASSTHROUGH_FLAGS
        if getattr(args, _dest(flag)) is not None
    }
    try:
        min_nnodes, nnodes = parse_nnodes(args.nnodes)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    spec = LaunchSpec(
        target=args.target,
        target_args=tuple(args.target_args),
        is_module=args.module,
        nproc_per_node=parse_nproc_per_node(args.nproc_per_node),
        nnodes=nnodes,
        min_nnodes=min_nnodes if min_nnodes != nnodes else None,
        rdzv_timeout=args.rdzv_timeout,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        gpus=None if args.gpus is None else parse_gpus(args.gpus),
        start_method=args.start_method,
        worker_env=worker_env,
    )
    return validate(apply_slurm(spec, os.environ))


def prepare(spec: LaunchSpec) -> tuple[int, int, dict[str, str]]:
    """Checks needing the machine (ports, GPUs): (nproc_per_node, GPUs in use, env for workers)."""
    num_cores = devices.count_cpu_cores()
    if spec.gpus is not None:
        devices.cuda_visible_devices_for(spec.gpus, os.environ)  # conflict check, before torch
    if spec.master_port is not None and spec.node_rank == 0 and spec.rdzv_backend == "static":
        ports.check_master_port(spec.master_port)
    if spec.gpus is not None:
        num_gpus = devices.count_visible_gpus()
        devices.check_gpu_indices(spec.gpus, num_gpus)
        num_gpus_in_use = len(spec.gpus)
    else:
        num_gpus_in_use = devices.count_visible_gpus()
    nproc = devices.resolve_nproc(spec.nproc_per_node, spec.gpus, lambda: num_gpus_in_use, num_cores)
    env = devices.worker_env_for_devices(nproc, spec.gpus, os.environ, num_cores)
    env.update(spec.worker_env)
    return nproc, num_gpus_in_use, env


def main(args: argparse.Namespace) -> int:
    """`phalanx run`: validate, export the workers' environment, launch; return the exit code."""
    try:
        spec = spec_from_args(args)
        nproc, num_gpus_in_use, env = prepare(spec)
        node = plan_for(spec, os.environ)  # multi-node: interface, own address, store host
    except (LaunchError, *CLUSTER_ERRORS) as error:
        print(f"{PROG_ERROR} {error}", file=sys.stderr)
        return EXIT_USAGE
    if node is not None:
        env.update(node.env)
    os.environ.update(env)  # the elastic agent passes its environment on to every worker
    from phalanx.launch.agent import launch

    return launch(spec, nproc, num_gpus_in_use, node)
