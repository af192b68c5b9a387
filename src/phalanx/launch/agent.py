"""Hands a validated `LaunchSpec` to torch's elastic agent and reports failed ranks.

Workers are started by `torch.distributed.launcher.api.elastic_launch`, the machinery behind
torchrun, so they see exactly torchrun's environment. torch is imported here, lazily, only once
the spec is valid.

Start method: with "fork", each worker is forked from this process after torch is imported, so
workers skip the ~1-2 s `import torch` (see bench/startup.py). CUDA must not be initialised before
a fork, so this module never does (GPUs are counted through NVML), and "auto" uses fork only when
no GPU is in use; "spawn" (a fresh `python -m phalanx.launch.worker`, like torchrun) is the escape
hatch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
import warnings
from typing import Any, Iterator

from phalanx import config, refusal
from phalanx.launch.node_setup import store_address
from phalanx.launch.rendezvous import (
    BOUND_C10D_BACKEND,
    BOUND_ETCD_BACKEND,
    BOUND_ETCD_V2_BACKEND,
    BOUND_STATIC_BACKEND,
    NodeSetup,
    describe_rendezvous_failure,
    rendezvous_configs,
    split_endpoint,
)
from phalanx.cluster import slurm_job
from phalanx.config import kinds
from phalanx.launch import etcd_store, local_rank, preemption, report, restarts, torchrun_flags
from phalanx.launch.private_tmp import private_tempdir
from phalanx.launch.spec import LaunchSpec

LOOPBACK = "127.0.0.1"
CHECKPOINT_DIR_VARIABLE = config.BY_NAME["checkpoint_dir"].env or ""
MULTINODE_RUN_ID = "phalanx"


def choose_start_method(requested: str, num_gpus_in_use: int) -> str:
    """'auto' -> fork for CPU-only runs, spawn when GPUs are in use; explicit choices win."""
    if requested != "auto":
        return requested
    return "spawn" if num_gpus_in_use > 0 else "fork"


def rendezvous_settings(spec: LaunchSpec, node: NodeSetup | None = None) -> dict[str, Any]:
    """LaunchConfig fields for the rendezvous, following torchrun's rules with a loopback default.

    Single node, no port and no endpoint: a store on 127.0.0.1 port 0, so the kernel picks a
    free port (no race, and a busy 29500 never matters); workers get MASTER_ADDR=127.0.0.1 and the
    store's port, and connect over loopback.

    Static rendezvous (one node or several) uses BOUND_STATIC_BACKEND: torch's static rendezvous
    with a store that listens only on the named address (loopback on one node), where torch's own
    store would listen on every interface. A single node with c10d (or --standalone) is the same
    job, so it gets the bound store too, on the endpoint's host (loopback by default).
    """
    # Every node must use the same run id (it prefixes the store's keys): a per-node uuid would
    # make the nodes wait for each other forever; torchrun defaults to a constant for the same reason.
    settings = _rendezvous_settings(spec, node)
    options = spec.agent or torchrun_flags.AgentOptions()
    # --rdzv-conf wins over phalanx's computed settings, as in torchrun, except the static node rank
    user = {key: value for key, value in options.rdzv_conf.items() if key != "rank"}
    settings["rdzv_configs"] = {**settings["rdzv_configs"], **user}
    if options.local_addr:
        settings["local_addr"] = options.local_addr
    return settings


def _single_node_c10d_endpoint(spec: LaunchSpec) -> str | None:
    """One node with c10d: the same job as static, so the store can listen on the endpoint's host only."""
    if spec.rdzv_backend != "c10d" or not spec.single_node or spec.min_nnodes not in (None, 1):
        return None
    host, port = split_endpoint(spec.rdzv_endpoint) if spec.rdzv_endpoint else (LOOPBACK, 0)
    return f"{LOOPBACK if host == 'localhost' else host}:{port or 0}"


def _rendezvous_settings(spec: LaunchSpec, node: NodeSetup | None) -> dict[str, Any]:
    run_id = spec.rdzv_id or (uuid.uuid4().hex if spec.single_node else MULTINODE_RUN_ID)
    c10d_endpoint = _single_node_c10d_endpoint(spec)
    if c10d_endpoint is not None:
        return {
            "rdzv_backend": BOUND_STATIC_BACKEND,
            "rdzv_endpoint": c10d_endpoint,
            "local_addr": c10d_endpoint.rpartition(":")[0].strip("[]"),
            "run_id": run_id,
            "rdzv_configs": {"rank": 0},
        }
    if spec.rdzv_backend == "static" and not spec.rdzv_endpoint and spec.single_node and spec.master_port is None:
        return {
            "rdzv_backend": BOUND_STATIC_BACKEND,
            "rdzv_endpoint": f"{LOOPBACK}:0",
            "local_addr": LOOPBACK,
            "run_id": run_id,
            "rdzv_configs": {"rank": 0},
        }
    # Multi-node: timeouts, is_host and this node's address come from phalanx.cluster (`node`).
    configs = rendezvous_configs(spec.rdzv_backend, spec.rdzv_timeout, node) if not spec.single_node else {}
    local_addr = node.local_addr if node is not None else None
    if local_addr is None and spec.single_node and spec.rdzv_backend == "etcd-v2":
        local_addr = LOOPBACK  # the workers' store is this node's: loopback, as static and c10d have it
    if spec.rdzv_backend in etcd_store.ETCD_BACKENDS:  # how long etcd may be away mid-job (etcd_store.py)
        configs = {**configs, etcd_store.OUTAGE_CONFIG_KEY: spec.rdzv_timeout}
    if spec.rdzv_backend == "static":
        host = spec.master_addr or LOOPBACK
        endpoint = spec.rdzv_endpoint or f"{host}:{spec.master_port}"
        return {
            "rdzv_backend": BOUND_STATIC_BACKEND,
            "rdzv_endpoint": endpoint,
            "local_addr": local_addr,
            "run_id": run_id,
            "rdzv_configs": {"rank": spec.node_rank, **configs},
        }
    return {
        # c10d's and etcd-v2's stores bind this node's address only, not every interface
        "rdzv_backend": {"c10d": BOUND_C10D_BACKEND, "etcd-v2": BOUND_ETCD_V2_BACKEND, "etcd": BOUND_ETCD_BACKEND}.get(
            spec.rdzv_backend, spec.rdzv_backend
        ),
        "rdzv_endpoint": spec.rdzv_endpoint,
        "local_addr": local_addr,
        "run_id": run_id,
        "rdzv_configs": configs,
    }


# torch packages every phalanx worker imports (checkpoints, DTensor, FSDP2, DDP, ZeRO) and torch._dynamo,
# which the first optimizer a process builds imports: seconds per process, most of a restart's time
# (bench/recovery.py). Imported once here before forking, no worker imports them again.
RUNTIME_TORCH_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "torch.distributed.algorithms.join",
    "torch.nn.parallel",
    "torch._dynamo",
)


def warm_imports(start_method: str, max_restarts: int) -> None:
    """With fork and restarts allowed: import the runtime's torch packages in the launcher, so forked
    workers (the first ones and every restart's) find them imported. Torch only: never phalanx's
    runtime, and nothing that initialises CUDA (fork is only chosen without GPUs in use)."""
    if start_method != "fork" or max_restarts <= 0:
        return
    import importlib

    for name in RUNTIME_TORCH_MODULES:
        importlib.import_module(name)


def entrypoint_for(spec: LaunchSpec, start_method: str) -> tuple[Any, list[str]]:
    """The agent's entrypoint and arguments: a function when forking (or --run-path), a command otherwise.

    --pass-local-rank puts `FLAG=${local_rank}` before the script's arguments, where
    torch.distributed.launch put it; torch's agent substitutes each worker's local rank.
    """
    options = spec.agent or torchrun_flags.AgentOptions()
    passed = [local_rank.worker_argument(spec.pass_local_rank)] if spec.pass_local_rank else []
    script_args = [*passed, *spec.target_args]
    if options.no_python:
        return spec.target, script_args
    if start_method == "fork" or options.run_path:
        from phalanx.launch.worker import run_forked, run_in_process

        function = run_forked if start_method == "fork" else run_in_process
        return function, [spec.target, spec.is_module, *script_args]  # type: ignore[list-item]
    command = os.environ.get("PYTHON_EXEC", sys.executable)  # torchrun honours PYTHON_EXEC too
    module_flag = ["-m"] if spec.is_module else []
    return command, ["-u", "-m", "phalanx.launch.worker", *module_flag, spec.target, *script_args]


@contextlib.contextmanager
def no_cuda_init() -> Iterator[None]:
    """LaunchConfig asks `torch.cuda.is_available()`; make it use NVML, which leaves CUDA alone."""
    key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[key]
        else:
            os.environ[key] = previous


def launch(
    spec: LaunchSpec,
    nproc_per_node: int,
    num_gpus_in_use: int,
    node: NodeSetup | None = None,
    verbose: bool = False,
    log_dir: str | None = None,
) -> int:
    """Run the workers to completion; return the launcher's exit code (the first failed rank's).

    torch's agent logging goes to `log_dir`/launcher.log, and to the terminal only when `verbose`.
    torch's own temporary files (error pickles, its log directory) go with the launch (private_tmp.py).
    """
    with private_tempdir():
        return _launch(spec, nproc_per_node, num_gpus_in_use, node, verbose, log_dir)


def _launch(
    spec: LaunchSpec,
    nproc_per_node: int,
    num_gpus_in_use: int,
    node: NodeSetup | None,
    verbose: bool,
    log_dir: str | None,
) -> int:
    start_method = choose_start_method(spec.start_method, num_gpus_in_use)
    # Lazy and narrow: the launcher API, not `import torch.distributed.run` and its parser.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from phalanx.launch import bound_store

    bound_store.register()
    checkpoint_dir = (
        spec.checkpoint_dir or spec.worker_env.get(CHECKPOINT_DIR_VARIABLE) or os.environ.get(CHECKPOINT_DIR_VARIABLE)
    )
    taken = kinds.signal_numbers(spec.preemption_signals)
    stopper = preemption.Stopper(taken, spec.preempt_grace, checkpoint_dir) if taken else None
    agent_kwargs = torchrun_flags.launch_config_kwargs(spec.agent or torchrun_flags.AgentOptions())
    if stopper is not None:  # these are phalanx's to handle (launch/preemption.py), not torch's
        agent_kwargs["signals_to_handle"] = preemption.without_signals(agent_kwargs["signals_to_handle"], taken)

    with no_cuda_init():
        config = LaunchConfig(
            min_nodes=spec.min_nnodes or spec.nnodes,
            max_nodes=spec.nnodes,
            nproc_per_node=nproc_per_node,
            max_restarts=spec.max_restarts,
            start_method=start_method,
            **rendezvous_settings(spec, node),
            **agent_kwargs,
        )
    entrypoint, args = entrypoint_for(spec, start_method)
    warm_imports(start_method, spec.max_restarts)
    # Python >= 3.12 warns on fork from a threaded process; the agent's threads are not used in the
    # child (it only runs the worker function), which is the case that warning does not apply to.
    warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
    seen = restarts.Observations()
    log_path = os.path.join(log_dir, report.AGENT_LOG_NAME) if log_dir else None
    try:
        if stopper is not None:
            stopper.install()
        with (
            report.quiet_agent_logging(log_path, verbose),
            restarts.agent_class_installed(
                checkpoint_dir, seen, stopper, node_name=node.local_addr if node is not None else ""
            ),
        ):
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        message = restarts.refused(error.failures)
        if message is not None:  # every rank refused the same at prepare: once, as a setting refused before launch
            print(f"phalanx run: error: {message}", file=sys.stderr, flush=True)
            return refusal.EXIT_CODE
        if stopper is not None and stopper.takes_over(error.failures):
            if (
                stopper.outcome is None
                and checkpoint_dir
                and not (stopper.killed_after_grace or stopper.killed_by_third)
            ):
                print(_failures(error, nproc_per_node, seen, log_dir), file=sys.stderr, flush=True)
            return _say_preempted(stopper, spec)
        print(_failures(error, nproc_per_node, seen, log_dir), file=sys.stderr, flush=True)
        return report.first_exit_code(error, seen.progress, seen.ended_at)
    except (RendezvousError, DistError, TimeoutError) as error:
        if spec.single_node:
            raise
        host, port = store_address(spec)
        print(
            describe_rendezvous_failure(
                error,
                backend=spec.rdzv_backend,
                host=host or LOOPBACK,
                port=port,
                nnodes=(spec.min_nnodes or spec.nnodes, spec.nnodes),
                node_rank=spec.node_rank if spec.rdzv_backend == "static" else None,
                timeout_s=spec.rdzv_timeout,
                setup=node,
            ),
            file=sys.stderr,
            flush=True,
        )
        return 1
    except etcd_store.RendezvousStoreLost as error:  # no preemption signals: no checkpoint to stop with
        print(
            f"{error} (no --preemption-signals are set: the workers were stopped without one)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except SignalException as error:
        if stopper is not None and stopper.active:
            return _say_preempted(stopper, spec)
        print(f"phalanx: stopped by {error.sigval.name}; workers were terminated", file=sys.stderr, flush=True)
        return 128 + int(error.sigval)
    finally:
        if stopper is not None:
            stopper.uninstall()
    if stopper is not None and stopper.signal is not None:
        print(
            f"phalanx: {stopper.signal.name} received, but the workers had finished their work first",
            file=sys.stderr,
            flush=True,
        )
    return 0


def _failures(error: Any, nproc_per_node: int, seen: restarts.Observations, log_dir: str | None) -> str:
    return report.format_failures(error, nproc_per_node, seen.progress, log_dir, ended_at=seen.ended_at)


def _say_preempted(stopper: preemption.Stopper, spec: LaunchSpec) -> int:
    """Print the preemption line, then (node 0, when asked and saved) requeue the SLURM job, whose
    requeue ends this allocation; return the exit code."""
    outcome = stopper.final()
    job = slurm_job.job_id(os.environ)
    requeue = (
        outcome.saved
        and spec.node_rank == 0
        and slurm_job.requeue_wanted(spec.requeue, os.environ, stopper.checkpoint_dir)
    )
    after = f"requeueing SLURM job {job}: its next allocation resumes from it" if requeue else None
    print(outcome.line(after), file=sys.stderr, flush=True)
    if requeue and job is not None:
        why_not = slurm_job.requeue(job)
        if why_not is not None:
            print(
                f"phalanx: requeueing SLURM job {job} failed ({why_not}); run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
    return outcome.exit_code
