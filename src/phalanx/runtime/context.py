"""Who this process is in the job: one explicit, immutable context built once from the env."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from phalanx import config, envvars
from phalanx.cluster.mpi import torch_env_from_mpi
from phalanx.cluster.slurm import torch_env_from_slurm
from phalanx.runtime.world_check import refuse_silent_world_of_one


class DataParallelLayout(Protocol):
    """What a context needs of a parallel plan (strategies/plan/parallel_plan.py, a room above)."""

    @property
    def dp_size(self) -> int: ...

    def dp_rank(self, rank: int) -> int: ...


@dataclass(frozen=True)
class DistContext:
    """Rank layout and device of this process.

    A plain `python train.py` (no launcher variables) is a world of one on the best device.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"
    init_method: str | None = None
    """Where to rendezvous when no launcher set MASTER_ADDR/PORT (srun, mpiexec); None: torch's env://."""
    adopted: bool = False
    """True when the process group was initialised before Phalanx() (mp.spawn, another library)."""
    dp_rank: int = -1
    """Which shard of the data this rank reads: its index over the data-parallel mesh dims (ranks
    of one tensor-parallel group read the same); -1 until the layout is known: the rank."""
    dp_size: int = 0
    """Ranks reading different data (the data-parallel dims); 0 until the layout is known: the world."""

    def __post_init__(self) -> None:
        if self.dp_size == 0:
            object.__setattr__(self, "dp_size", self.world_size)
        if self.dp_rank == -1:
            object.__setattr__(self, "dp_rank", self.rank)

    def with_data_parallel(self, plan: DataParallelLayout) -> "DistContext":
        """This context with the data-parallel coordinates the parallel plan gives it."""
        return dataclasses.replace(self, dp_rank=plan.dp_rank(self.rank), dp_size=plan.dp_size)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, cpu: bool = False) -> "DistContext":
        """The layout of this process, from the first source that describes it.

        1. A process group the script (or another library) already initialised: its rank, size and
           backend (`mp.spawn` + `init_process_group`, then `Phalanx()`).
        2. torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...), as `phalanx run` sets them.
        3. SLURM's under plain `srun python train.py`; MPI's under `mpiexec python train.py`.
        A world of one is refused when any sign of a multi-process launch is present.
        """
        env = os.environ if env is None else env
        group = _initialised_group()
        if group is not None:
            return cls.from_group(*group, env=env, cpu=cpu)
        cluster_env = torch_env_from_slurm(env)  # `srun python train.py`: no launcher variables
        if not cluster_env:
            cluster_env = torch_env_from_mpi(env)  # `mpiexec python train.py`
        init_method = None
        if cluster_env:
            init_method = f"tcp://{cluster_env[envvars.MASTER_ADDR]}:{cluster_env[envvars.MASTER_PORT]}"
            env = {**env, **cluster_env}
        world_size = _int(env, envvars.WORLD_SIZE, 1)
        rank = _int(env, envvars.RANK, 0)
        local_rank = _int(env, envvars.LOCAL_RANK, 0)
        local_world_size = _int(env, envvars.LOCAL_WORLD_SIZE, world_size if envvars.WORLD_SIZE in env else 1)
        node_rank = _int(env, envvars.GROUP_RANK, rank // max(local_world_size, 1))
        if not 0 <= rank < world_size:
            raise ValueError(
                f"RANK={rank} is outside WORLD_SIZE={world_size}. These variables come from the "
                "launcher: start the script with `phalanx run` or `torchrun` rather than setting them by hand."
            )
        if world_size == 1:
            refuse_silent_world_of_one(env)
        device, backend = _pick_device(local_rank, cpu)
        return cls(rank, local_rank, world_size, local_world_size, node_rank, device, backend, init_method)

    @classmethod
    def from_group(
        cls,
        rank: int,
        world_size: int,
        backend: str,
        env: Mapping[str, str] | None = None,
        cpu: bool = False,
        gpu_count: int | None = None,
    ) -> "DistContext":
        """Adopt an initialised process group: rank, size and backend are the group's.

        local_rank is LOCAL_RANK when set, else rank % the local world size (LOCAL_WORLD_SIZE,
        else one process per visible GPU, else every rank on this machine). The device is
        cuda:local_rank under an NCCL group (or torch's "fake" backend, whose collectives do no work:
        one process sizes a rank of a larger world: bench/memory.py --fake-world), the CPU otherwise.
        """
        env = os.environ if env is None else env
        if world_size == 1:
            refuse_silent_world_of_one(env)
        use_cuda = ("nccl" in backend or (backend == "fake" and torch.cuda.is_available())) and not cpu
        if gpu_count is None:
            gpu_count = torch.cuda.device_count() if use_cuda else 0
        default_local = min(world_size, gpu_count) if gpu_count > 0 else world_size
        local_world_size = _int(env, envvars.LOCAL_WORLD_SIZE, default_local)
        local_rank = _int(env, envvars.LOCAL_RANK, rank % max(local_world_size, 1))
        node_rank = rank // max(local_world_size, 1)
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        return cls(rank, local_rank, world_size, local_world_size, node_rank, device, backend, adopted=True)


def _initialised_group() -> tuple[int, int, str] | None:
    """(rank, world size, backend) of the default process group when one exists already."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.group.WORLD in WORLD_OF_ONE_GROUPS:
        return None  # the group phalanx made for a world of one (process_group.py) is no group to adopt
    return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())


WORLD_OF_ONE_GROUPS: list = []
"""The default group process_group.py made for a world of one, while it lives (a list: no global statement)."""


@dataclass(frozen=True)
class AgentEnv:
    """What torch's elastic agent (torchrun, `phalanx run`) told this worker beyond its rank."""

    uses_agent_store: bool = False  # workers may connect to the agent's TCPStore
    master_addr: str = ""
    master_port: int = 0
    error_file: str | None = None  # where a failure's traceback goes for the launcher's report
    phalanx_launcher: bool = False  # `phalanx run` supervises this worker (and reports its preemption)
    attempt: str = "0"
    """The attempt's name, the same on every node: PHALANX_ATTEMPT from `phalanx run`'s agent, else the
    restart count (torchrun). Scopes the store keys each attempt writes."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AgentEnv":
        env = os.environ if env is None else env
        port = env.get(envvars.MASTER_PORT, "")
        return cls(
            env.get(envvars.TORCHELASTIC_USE_AGENT_STORE) == "True",
            env.get(envvars.MASTER_ADDR, ""),
            int(port) if port.isdigit() else 0,
            env.get(envvars.TORCHELASTIC_ERROR_FILE) or None,
            env.get(envvars.PHALANX_LAUNCHER) == "1",
            env.get(envvars.PHALANX_ATTEMPT) or env.get(envvars.TORCHELASTIC_RESTART_COUNT, "0"),
        )


def launcher_settings(env: Mapping[str, str] | None = None) -> config.Layer:
    """The settings the launcher handed this process as PHALANX_* variables, checked."""
    return config.from_env(os.environ if env is None else env)


def handed_plan(env: Mapping[str, str] | None = None) -> str:
    """The parallel plan `phalanx run` built for its workers (strategies/plan/job_plan.py); "" without one."""
    return (os.environ if env is None else env).get(envvars.PHALANX_PLAN, "")


@dataclass(frozen=True)
class ParityRequest:
    """What `phalanx parity` asks of this worker (runtime/parity_record.py)."""

    record_path: str
    steps: int
    batch_scale: int


def parity_request(env: Mapping[str, str] | None = None) -> ParityRequest | None:
    """Set by `phalanx parity` for the workers of its two runs; None otherwise."""
    env = os.environ if env is None else env
    path = env.get(envvars.PHALANX_PARITY_RECORD)
    if not path:
        return None
    return ParityRequest(
        path, _int(env, envvars.PHALANX_PARITY_STEPS, 3), _int(env, envvars.PHALANX_PARITY_BATCH_SCALE, 1)
    )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _pick_device(local_rank: int, cpu: bool) -> tuple[torch.device, str]:
    """CUDA device LOCAL_RANK with NCCL when GPUs are visible, else CPU with gloo."""
    if not cpu and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get(envvars.CUDA_VISIBLE_DEVICES)!r}). "
                "Launch at most one process per visible GPU (phalanx run --nproc-per-node auto)."
            )
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def mark_phalanx_created(env: Mapping[str, str] | None = None) -> None:
    """Under `phalanx run`: tell the launcher a Phalanx() was created, so its settings reached the
    script (it names the settings that did not, otherwise: launch/worker_notes.py)."""
    notes = (os.environ if env is None else env).get(envvars.PHALANX_WORKER_NOTES)
    if notes:
        os.makedirs(notes, exist_ok=True)
        open(os.path.join(notes, envvars.PHALANX_CREATED_MARKER), "a").close()
