"""`mpiexec -n N python train.py`: rank and size from the MPI launcher's environment.

MPI launchers (MPICH/Intel MPI's hydra, Open MPI's mpirun, MVAPICH) export each process's rank
and the job size under their own names; this module maps them to torch's RANK & co. Only the
address and port of rank 0's store cannot be read from the environment: they are chosen on rank 0
and shared through MPI itself (mpi4py, the optional extra `phalanx[mpi]`), once, at start-up.
The env parsing is pure functions over a dict, so every launcher's case is a unit test.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Callable, Mapping

from phalanx import envvars

MPI_INSTALL_HINT = "pip install 'phalanx[mpi]' (mpi4py; plus an MPI such as `pip install mpich`)"

# (rank, size, local rank, local size) per launcher family; the first whose rank and size are set wins.
_LAYOUTS: tuple[tuple[str, str, str, str], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (hydra)
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


class MpiError(RuntimeError):
    """An MPI launch phalanx cannot join; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class MpiWorld:
    """This process's place in the MPI job, and which variables said so (for messages)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    source: str  # e.g. "PMI_RANK/PMI_SIZE"


def read_mpi_world(env: Mapping[str, str]) -> MpiWorld | None:
    """The MPI job this process belongs to, or None when no MPI launcher started it."""
    for rank_key, size_key, local_key, local_size_key in _LAYOUTS:
        if env.get(rank_key) and env.get(size_key):
            rank, size = _int(env, rank_key), _int(env, size_key)
            local_size = _int(env, local_size_key) if env.get(local_size_key) else size
            local_rank = _int(env, local_key) if env.get(local_key) else rank % max(local_size, 1)
            if not 0 <= rank < size or not 0 <= local_rank < local_size:
                raise MpiError(
                    f"{rank_key}={rank}, {local_key}={local_rank} do not fit {size_key}={size} "
                    f"({local_size} on this node). HINT: do not set MPI variables by hand."
                )
            return MpiWorld(rank, size, local_rank, local_size, f"{rank_key}/{size_key}")
    return None


def torch_env_from_mpi(
    env: Mapping[str, str],
    exchange: Callable[[MpiWorld], tuple[str, int]] | None = None,
) -> dict[str, str]:
    """torchrun's variables for a process started by `mpiexec python train.py`; {} when not applicable.

    Applies only when torchrun's RANK is absent (a launcher's own variables win) and the MPI job
    has several processes. MASTER_ADDR/MASTER_PORT already in the environment are used as given;
    otherwise `exchange` (default: `store_address_over_mpi`) agrees on them.
    """
    world = read_mpi_world(env)
    if envvars.RANK in env or world is None or world.size < 2:
        return {}
    if env.get(envvars.MASTER_ADDR) and env.get(envvars.MASTER_PORT):
        addr, port = env[envvars.MASTER_ADDR], int(env[envvars.MASTER_PORT])
    else:
        addr, port = (exchange or store_address_over_mpi)(world)
    return {
        envvars.RANK: str(world.rank),
        envvars.LOCAL_RANK: str(world.local_rank),
        envvars.WORLD_SIZE: str(world.size),
        envvars.LOCAL_WORLD_SIZE: str(world.local_size),
        envvars.GROUP_RANK: str(world.rank // max(world.local_size, 1)),
        envvars.MASTER_ADDR: addr,
        envvars.MASTER_PORT: str(port),
    }


def store_address_over_mpi(world: MpiWorld) -> tuple[str, int]:
    """Rank 0's address and a free port on it, broadcast to every rank through mpi4py.

    All ranks on one host: loopback (nothing leaves the machine). Several hosts: rank 0's hostname.
    """
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise MpiError(
            f"this process was started by an MPI launcher ({world.source}: rank {world.rank} of "
            f"{world.size}), and phalanx needs mpi4py to agree on rank 0's address ({error}). "
            f"HINT: {MPI_INSTALL_HINT}; or export MASTER_ADDR and MASTER_PORT to every rank."
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != world.size:
        raise MpiError(
            f"mpi4py sees {comm.Get_size()} process(es) but {world.source} says {world.size}. "
            "HINT: install mpi4py against the MPI that runs mpiexec (`pip install mpich mpi4py`)."
        )
    hosts = comm.allgather(socket.gethostname())
    port = _free_port() if world.rank == 0 else 0
    port = comm.bcast(port, root=0)
    addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
    return addr, port


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise MpiError(f"environment variable {name}={env[name]!r} is not an integer") from None
