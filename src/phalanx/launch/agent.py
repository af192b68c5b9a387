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

from phalanx import envvars
from phalanx.cluster.launch_plan import store_address
from phalanx.cluster.rendezvous import BOUND_STATIC_BACKEND, NodePlan, describe_rendezvous_failure, rendezvous_configs
from phalanx.launch import report, restarts
from phalanx.launch.report import format_failures, trim_traceback  # noqa: F401 - public here before
from phalanx.launch.spec import LaunchSpec

LOOPBACK = "127.0.0.1"
MULTINODE_RUN_ID = "phalanx"


def choose_start_method(requested: str, num_gpus_in_use: int) -> str:
    """'auto' -> fork for CPU-only runs, spawn when GPUs are in use; explicit choices win."""
    if requested != "auto":
        return requested
    return "spawn" if num_gpus_in_use > 0 else "fork"


def rendezvous_settings(spec: LaunchSpec, node: NodePlan | None = None) -> dict[str, Any]:
    """LaunchConfig fields for the rendezvous, following torchrun's rules with a loopback default.

    Single node, no port and no endpoint: a store on 127.0.0.1 port 0, so the kernel picks a
    free port (no race, and a busy 29500 never matters); workers get MASTER_ADDR=127.0.0.1 and the
    store's port, and connect over loopback.

    Static rendezvous (one node or several) uses BOUND_STATIC_BACKEND: torch's static rendezvous
    with a store that listens only on the named address (loopback on one node), where torch's own
    store would listen on every interface.
    """
    # Every node must use the same run id (it prefixes the store's keys): a per-node uuid would
    # make the nodes wait for each other forever; torchrun defaults to a constant for the same reason.
    run_id = spec.rdzv_id or (uuid.uuid4().hex if spec.single_node else MULTINODE_RUN_ID)
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
        "rdzv_backend": spec.rdzv_backend,
        "rdzv_endpoint": spec.rdzv_endpoint,
        "local_addr": local_addr,
        "run_id": run_id,
        "rdzv_configs": configs,
    }


def entrypoint_for(spec: LaunchSpec, start_method: str) -> tuple[Any, list[str]]:
    """The agent's entrypoint and arguments: a function when forking, a command when spawning."""
    if start_method == "fork":
        from phalanx.launch.worker import run_forked

        return run_forked, [spec.target, spec.is_module, *spec.target_args]  # type: ignore[list-item]
    command = os.environ.get("PYTHON_EXEC", sys.executable)  # torchrun honours PYTHON_EXEC too
    module_flag = ["-m"] if spec.is_module else []
    return command, ["-u", "-m", "phalanx.launch.worker", *module_flag, spec.target, *spec.target_args]


@contextlib.contextmanager
def _no_cuda_init() -> Iterator[None]:
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


def launch(spec: LaunchSpec, nproc_per_node: int, num_gpus_in_use: int, node: NodePlan | None = None,
           verbose: bool = False, log_dir: str | None = None) -> int:
    """Run the workers to completion; return the launcher's exit code (the first failed rank's).

    torch's agent logging goes to `log_dir`/launcher.log, and to the terminal only when `verbose`.
    """
    start_method = choose_start_method(spec.start_method, num_gpus_in_use)
    # Lazy and narrow: the launcher API, not `import torch.distributed.run` and its parser.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from phalanx.cluster import bound_store

    bound_store.register()

    with _no_cuda_init():
        config = LaunchConfig(
            min_nodes=spec.min_nnodes or spec.nnodes,
            max_nodes=spec.nnodes,
            nproc_per_node=nproc_per_node,
            max_restarts=spec.max_restarts,
            start_method=start_method,
            **rendezvous_settings(spec, node),
        )
    entrypoint, args = entrypoint_for(spec, start_method)
    # Python >= 3.12 warns on fork from a threaded process; the agent's threads are not used in the
    # child (it only runs the worker function), which is the case that warning does not apply to.
    warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
    seen = restarts.Observations()
    log_path = os.path.join(log_dir, report.AGENT_LOG_NAME) if log_dir else None
    try:
        with report.quiet_agent_logging(log_path, verbose), \
                restarts.agent_class_installed(spec.worker_env.get(envvars.PHALANX_CHECKPOINT_DIR)
                                               or os.environ.get(envvars.PHALANX_CHECKPOINT_DIR), seen):
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        print(format_failures(error, nproc_per_node, seen.progress, log_dir), file=sys.stderr, flush=True)
        return report.first_exit_code(error, seen.progress)
    except (RendezvousError, DistError, TimeoutError) as error:
        if spec.single_node:
            raise
        host, port = store_address(spec)
        print(describe_rendezvous_failure(
            error, backend=spec.rdzv_backend, host=host or LOOPBACK, port=port,
            nnodes=(spec.min_nnodes or spec.nnodes, spec.nnodes),
            node_rank=spec.node_rank if spec.rdzv_backend == "static" else None,
            timeout_s=spec.rdzv_timeout, plan=node,
        ), file=sys.stderr, flush=True)
        return 1
    except SignalException as error:
        print(f"phalanx: stopped by {error.sigval.name}; workers were terminated", file=sys.stderr, flush=True)
        return 128 + int(error.sigval)
    return 0
