"""`LaunchSpec`: everything `phalanx run` was asked to do, as one validated value.

Each value was parsed and range-checked once, by its row of the settings schema (config/schema.py);
`validate` checks only what no single row can: how the values fit together (node ranks, GPUs and
process counts, multi-node addresses, the script). Pure (no torch, no processes), so every user
error is reported before anything is spawned. Device- and port-dependent checks live in
`devices.py` and `ports.py`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from phalanx.launch.launch_error import LaunchError  # noqa: F401 (its public home: phalanx.launch.spec.LaunchError)

if TYPE_CHECKING:
    from phalanx.launch.torchrun_flags import AgentOptions


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """A validated launch request. Fields use torchrun's vocabulary."""

    target: str
    """The training script path, or a module name when `is_module`."""
    target_args: tuple[str, ...] = ()
    """Arguments for the script, passed through untouched."""
    is_module: bool = False
    """Run `target` like `python -m target`."""
    nproc_per_node: int | None = None
    """Workers on this node; None means auto (visible GPUs, else a CPU default)."""
    nnodes: int = 1
    """Number of nodes; the maximum when `min_nnodes` is set."""
    min_nnodes: int | None = None
    """Elastic lower bound (`--nnodes MIN:MAX`); None means a fixed size of `nnodes`."""
    rdzv_timeout: float = 600.0
    """Seconds the rendezvous may take before the launch fails with a report of what is missing."""
    node_rank: int = 0
    """This node's rank, for the static rendezvous."""
    master_addr: str | None = None
    """Address of node 0; None means 127.0.0.1 on a single node."""
    master_port: int | None = None
    """Port of the store on node 0; None on a single node means a free port chosen by the store."""
    rdzv_backend: str = "static"
    """torch elastic rendezvous backend (static, c10d, etcd...)."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous backend; empty for static (master_addr:master_port is used)."""
    rdzv_id: str = ""
    """Job id shared by all nodes of one run; empty means generated."""
    max_restarts: int = 0
    """How many times the whole worker group is restarted after a failure."""
    gpus: tuple[int, ...] | None = None
    """Physical GPU indices to use (exported as CUDA_VISIBLE_DEVICES); None means all visible."""
    start_method: str = "auto"
    """How workers start: fork (inherit the launcher's torch import), spawn, or auto."""
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra variables exported to every worker (phalanx settings such as PHALANX_STRATEGY)."""
    deepspeed: Any = None
    """The DeepSpeed config the settings were checked against (DeepSpeedConfig), if any."""
    settings: Any = None
    """The resolved settings (phalanx.config.Resolved), checked against the parallel layout once the
    process count is known."""
    allow_oversubscribe: bool = False
    """Start more workers than the node's cores and task limits allow (launch/capacity.py)."""
    nproc_kind: str = "auto"
    """With `nproc_per_node` None: "auto" (GPUs, else the CPU default), "gpu" or "cpu" (one per core)."""
    pass_local_rank: str | None = None
    """Append `<this>=<local rank>` to each worker's arguments (torch.distributed.launch scripts)."""
    verbose: bool = False
    """Show torch's elastic agent logging on the terminal too (it always goes to RUN_DIR/logs/launcher.log)."""
    agent: AgentOptions | None = None
    """torchrun's other settings, passed to torch's elastic agent (None: torchrun's defaults)."""
    checkpoint_dir: str | None = None
    """The workers' checkpoint root (resolved setting): restarts and preemption report from it."""
    preemption_signals: str = "SIGTERM,SIGUSR1"
    """Signals the launcher passes on and waits out while the workers save (`none`: torch's handling)."""
    preempt_grace: float = 120.0
    """Seconds the workers get to finish their step and checkpoint after a preemption signal."""
    requeue: str = "auto"
    """Requeue a preempted SLURM job once its checkpoint is saved: auto, on, off."""

    @property
    def single_node(self) -> bool:
        return self.nnodes == 1


def parse_gpus(value: str) -> tuple[int, ...]:
    """'1,3' -> (1, 3). Rejects empty items, negatives, non-integers and repeats."""
    items = [item.strip() for item in value.split(",")]
    try:
        indices = tuple(int(item) for item in items)
    except ValueError:
        raise LaunchError(f"--gpus must be a comma-separated list of GPU indices such as 0,1, got {value!r}") from None
    if any(index < 0 for index in indices):
        raise LaunchError(f"--gpus indices must be >= 0, got {value!r}")
    if len(set(indices)) != len(indices):
        raise LaunchError(f"--gpus lists a GPU twice: {value!r}")
    return indices


def check_target(target: str, is_module: bool) -> None:
    """Fail fast when the script does not exist or the module cannot be imported."""
    if not is_module:
        if not os.path.isfile(target):
            raise LaunchError(
                f"training script {target!r} not found (working directory: {os.getcwd()}). "
                "HINT: check the path, or pass -m to run a module."
            )
        check_syntax(target)
        return
    # `python -m` searches the working directory first; do the same for the check.
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        if added:
            sys.path.remove(cwd)
    if not found:
        raise LaunchError(
            f"module {target!r} (-m) is not importable from {cwd}. "
            "HINT: install its package, run from the directory that contains it, or drop -m "
            "to run a script path."
        )


def check_syntax(path: str) -> None:
    """A script that does not compile fails here once, not as a traceback from every worker."""
    try:
        with open(path, "rb") as fp:
            source = fp.read()
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as error:
        where = f"{path}, line {error.lineno}" + (f", column {error.offset}" if error.offset else "")
        text = f": {error.text.strip()}" if error.text and error.text.strip() else ""
        raise LaunchError(
            f"training script {path!r} does not compile ({where}): {error.msg}{text}. "
            "HINT: fix it (python -m py_compile SCRIPT shows the same), then launch again"
        ) from None
    except (OSError, ValueError):  # unreadable, or null bytes: the worker's own error says it best
        return


def validate(spec: LaunchSpec) -> LaunchSpec:
    """Check a spec for contradictions between its values (each value on its own was checked by
    its schema row); return it unchanged."""
    if spec.min_nnodes is not None and spec.min_nnodes != spec.nnodes and spec.rdzv_backend == "static":
        raise LaunchError(
            f"--nnodes {spec.min_nnodes}:{spec.nnodes} is an elastic range, which the static rendezvous "
            "cannot do. HINT: add --rdzv-backend c10d --rdzv-endpoint HOST:PORT."
        )
    if not 0 <= spec.node_rank < spec.nnodes:
        raise LaunchError(
            f"--node-rank {spec.node_rank} is out of range for --nnodes {spec.nnodes}: "
            f"node ranks are 0..{spec.nnodes - 1}."
        )
    if spec.gpus is not None:
        if len(spec.gpus) == 0:
            raise LaunchError("--gpus is empty. HINT: list GPU indices such as --gpus 0,1")
        if spec.nproc_per_node is not None and spec.nproc_per_node != len(spec.gpus):
            raise LaunchError(
                f"--nproc-per-node {spec.nproc_per_node} conflicts with --gpus "
                f"{','.join(map(str, spec.gpus))} ({len(spec.gpus)} GPUs): one process runs per "
                "GPU. HINT: drop --nproc-per-node, or list as many GPUs as processes."
            )
    if spec.nnodes > 1 and spec.rdzv_backend == "static" and not spec.master_addr and not spec.rdzv_endpoint:
        raise LaunchError(
            f"--nnodes {spec.nnodes} needs the address of node 0. "
            "HINT: pass --master-addr HOST --master-port PORT (the same on every node)."
        )
    if spec.nnodes > 1 and spec.rdzv_backend == "static" and spec.master_port is None and not spec.rdzv_endpoint:
        raise LaunchError(f"--nnodes {spec.nnodes} needs a fixed --master-port shared by all nodes.")
    if spec.agent is None or not spec.agent.no_python:  # --no-python: an executable, checked by torchrun_flags
        check_target(spec.target, spec.is_module)
    return spec
