"""SLURM allocations as pure functions over the environment.

Two ways a phalanx job meets SLURM:
- `srun phalanx run train.py` (one task per node): the launcher reads nnodes, the node rank, the
  master address and a port from the allocation (`launch_settings`), and starts the workers itself.
- `srun python train.py` (one task per GPU): no launcher; the runtime maps SLURM_PROCID & co. to
  torch's RANK & co. (`torch_env_from_slurm`).
Nothing here imports torch or touches the network, so every case is a unit test over a dict.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from phalanx import envvars
from phalanx.cluster.hostlist import expand_hostlist, expand_tasks_per_node

MASTER_PORT_BASE = 15000
MASTER_PORT_SPAN = 15000
"""Ports derived from the job id fall in 15000..29999: below Linux's ephemeral range (32768+), so
they never collide with a client socket, and two jobs sharing a node get different ports unless
their ids are 15000 apart."""


class SlurmError(ValueError):
    """The SLURM allocation cannot run what was asked; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class SlurmAllocation:
    """What SLURM gave this process: hosts, where this node is among them, tasks and GPUs."""

    job_id: int
    hosts: tuple[str, ...]
    """The step's hosts inside srun, else the job's, in SLURM's order."""
    node_rank: int
    tasks_per_node: tuple[int, ...]
    """Tasks SLURM starts on each host (same order as `hosts`)."""
    gpus_on_node: int | None
    """GPUs allocated on this node (SLURM_GPUS_ON_NODE); None when the job asked for none."""
    in_step: bool
    """True inside `srun` (a job step); False in the batch script itself or an salloc shell."""

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @property
    def master_port(self) -> int:
        return master_port_for_job(self.job_id)

    @property
    def tasks_on_node(self) -> int:
        return self.tasks_per_node[self.node_rank]


@dataclasses.dataclass(frozen=True)
class SlurmLaunch:
    """Settings `phalanx run` takes from the allocation."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc_per_node: int | None
    """None: no GPUs in the allocation, so the launcher's own default applies."""
    rdzv_id: str


def in_slurm(env: Mapping[str, str]) -> bool:
    """Inside a SLURM allocation (batch script, salloc shell or srun step)."""
    return bool(env.get(envvars.SLURM_JOB_ID)) and bool(_nodelist(env))


def master_port_for_job(job_id: int) -> int:
    """A port every node of the job derives alike, and that differs between concurrent jobs."""
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def read_allocation(env: Mapping[str, str]) -> SlurmAllocation:
    """Parse the allocation; raise SlurmError naming the variable that is missing or inconsistent."""
    if not in_slurm(env):
        raise SlurmError(
            f"not inside a SLURM allocation ({envvars.SLURM_JOB_ID} or {envvars.SLURM_JOB_NODELIST} unset)"
        )
    in_step = envvars.SLURM_STEP_NUM_TASKS in env
    job_id = _int(env, envvars.SLURM_JOB_ID)
    hosts = tuple(expand_hostlist(_nodelist(env)))
    if not hosts:
        raise SlurmError(f"{envvars.SLURM_JOB_NODELIST} is empty")
    node_rank = _int(env, envvars.SLURM_NODEID, 0)
    if not 0 <= node_rank < len(hosts):
        raise SlurmError(
            f"{envvars.SLURM_NODEID}={node_rank} is outside the {len(hosts)} host(s) of "
            f"{_nodelist(env)!r}. HINT: launch with srun inside the allocation, not by hand."
        )
    tasks_raw = (in_step and env.get(envvars.SLURM_STEP_TASKS_PER_NODE)) or env.get(envvars.SLURM_TASKS_PER_NODE)
    if tasks_raw:
        tasks = tuple(expand_tasks_per_node(tasks_raw))
    else:  # older SLURM or a hand-made environment: the requested count, else one per node
        tasks = (_int(env, envvars.SLURM_NTASKS_PER_NODE, 1),) * len(hosts)
    if len(tasks) != len(hosts):
        raise SlurmError(
            f"SLURM lists {len(hosts)} host(s) ({_nodelist(env)!r}) but task counts for {len(tasks)} "
            f"({tasks_raw!r}); the allocation variables are inconsistent. HINT: do not override "
            "SLURM_* variables by hand."
        )
    return SlurmAllocation(job_id, hosts, node_rank, tasks, _gpus_on_node(env), in_step)


def launch_settings(
    env: Mapping[str, str],
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
) -> SlurmLaunch:
    """What `phalanx run` does inside SLURM, checked against what the user asked for.

    `nproc_per_node` / `nnodes`: the user's explicit values, None when left to the allocation.
    """
    alloc = read_allocation(env)
    if not alloc.in_step and alloc.nnodes > 1:
        raise SlurmError(
            f"phalanx run is running once, in the batch script, but the job has {alloc.nnodes} nodes "
            f"({', '.join(alloc.hosts[:4])}{', ...' if alloc.nnodes > 4 else ''}): the other nodes would "
            "never join. HINT: start it on every node with `srun --ntasks-per-node=1 phalanx run ...` "
            "(phalanx slurm writes such a script)."
        )
    if alloc.in_step and alloc.tasks_on_node != 1:
        raise SlurmError(
            f"SLURM started {alloc.tasks_on_node} tasks on this node ({envvars.SLURM_STEP_TASKS_PER_NODE}="
            f"{env.get(envvars.SLURM_STEP_TASKS_PER_NODE)!r}) and each runs `phalanx run`, which starts "
            "its own workers: the job would start tasks x nproc processes and hang. HINT: one task per "
            "node for phalanx run (`#SBATCH --ntasks-per-node=1`, `srun --ntasks-per-node=1`), or drop "
            "phalanx run and start one task per GPU with `srun python train.py`."
        )
    if nnodes is not None and nnodes != alloc.nnodes:
        raise SlurmError(
            f"--nnodes {nnodes} but the SLURM step runs on {alloc.nnodes} node(s) "
            f"({envvars.SLURM_JOB_NODELIST}={_nodelist(env)!r}). HINT: drop --nnodes inside SLURM, "
            f"or ask SLURM for {nnodes} node(s) (`#SBATCH --nodes={nnodes}`)."
        )
    nproc = _check_nproc(nproc_per_node, alloc)
    return SlurmLaunch(
        alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port, nproc, f"slurm-{alloc.job_id}"
    )


def _check_nproc(requested: int | None, alloc: SlurmAllocation) -> int | None:
    gpus = alloc.gpus_on_node
    if requested is None:
        return gpus or None
    if gpus and requested > gpus:
        raise SlurmError(
            f"--nproc-per-node {requested} but SLURM allocated {gpus} GPU(s) on this node "
            f"({envvars.SLURM_GPUS_ON_NODE}={gpus}): {requested - gpus} worker(s) would have no GPU. "
            f"HINT: use --nproc-per-node auto (= {gpus}), or ask SLURM for {requested} "
            f"(`#SBATCH --gpus-per-node={requested}`)."
        )
    return requested


def torch_env_from_slurm(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a process started by `srun python train.py`; {} when not applicable.

    Applies only inside an srun step and only when torchrun's RANK is absent (under `phalanx run`
    the launcher's variables win). Inside the batch script itself, SLURM_NTASKS describes tasks
    that are not running, so nothing is derived there.
    """
    if envvars.RANK in env or envvars.SLURM_PROCID not in env or envvars.SLURM_STEP_NUM_TASKS not in env:
        return {}
    alloc = read_allocation(env)
    world_size = _int(env, envvars.SLURM_STEP_NUM_TASKS)
    rank = _int(env, envvars.SLURM_PROCID)
    local_rank = _int(env, envvars.SLURM_LOCALID, 0)
    if not 0 <= rank < world_size or not 0 <= local_rank < alloc.tasks_on_node:
        raise SlurmError(
            f"SLURM_PROCID={rank}/SLURM_LOCALID={local_rank} do not fit {world_size} task(s) with "
            f"{alloc.tasks_on_node} on this node. HINT: do not set SLURM_* variables by hand."
        )
    return {
        envvars.RANK: str(rank),
        envvars.LOCAL_RANK: str(local_rank),
        envvars.WORLD_SIZE: str(world_size),
        envvars.LOCAL_WORLD_SIZE: str(alloc.tasks_on_node),
        envvars.GROUP_RANK: str(alloc.node_rank),
        envvars.MASTER_ADDR: env.get(envvars.MASTER_ADDR) or alloc.master_addr,
        envvars.MASTER_PORT: env.get(envvars.MASTER_PORT) or str(alloc.master_port),
    }


def _nodelist(env: Mapping[str, str]) -> str:
    if envvars.SLURM_STEP_NUM_TASKS in env and env.get(envvars.SLURM_STEP_NODELIST):
        return env[envvars.SLURM_STEP_NODELIST]
    return env.get(envvars.SLURM_JOB_NODELIST) or env.get(envvars.SLURM_NODELIST, "")


def _gpus_on_node(env: Mapping[str, str]) -> int | None:
    raw = env.get(envvars.SLURM_GPUS_ON_NODE)
    if raw:
        return _int(env, envvars.SLURM_GPUS_ON_NODE)
    listed = env.get(envvars.SLURM_STEP_GPUS) or env.get(envvars.SLURM_JOB_GPUS)
    if listed:
        return len([item for item in listed.split(",") if item.strip()])
    return None


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise SlurmError(f"{name} is not set inside the SLURM allocation")
        return default
    try:
        return int(raw)
    except ValueError:
        raise SlurmError(f"{name}={raw!r} is not an integer") from None
