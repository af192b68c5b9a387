"""Never a silent world of one: refuse to run alone when the job says it has several processes.

A script started by several processes that each decide they are alone trains N copies on all of
the data and prints everything N times, while nothing fails. When phalanx resolves a world of one,
`refuse_silent_world_of_one` looks for the signs of a multi-process launch and stops with what it
saw and what to do. Pure functions over the environment, for unit tests with a fake env.
"""

from __future__ import annotations

from typing import Mapping

from phalanx import envvars
from phalanx.cluster.mpi import MpiError, read_mpi_world


class LonelyWorldError(RuntimeError):
    """This process would run as a world of one although the job has several processes."""


def multi_process_signs(env: Mapping[str, str], group_world_size: int | None = None) -> list[str]:
    """Each sign of a multi-process launch, as a short description naming the variable seen.

    `group_world_size`: the size of a process group already initialised in this process, if any.
    A launcher that sets WORLD_SIZE=1 explicitly asked for one process: nothing else is a sign then.
    """
    signs: list[str] = []
    if group_world_size is not None and group_world_size > 1:
        signs.append(f"a process group of {group_world_size} ranks is already initialised")
    world = _positive_int(env.get(envvars.WORLD_SIZE))
    if world is not None:
        if world > 1:
            signs.append(f"{envvars.WORLD_SIZE}={world}")
        return signs
    if env.get(envvars.LOCAL_RANK) is not None and envvars.RANK not in env:
        signs.append(
            f"{envvars.LOCAL_RANK}={env[envvars.LOCAL_RANK]} is set without {envvars.RANK} and {envvars.WORLD_SIZE}"
        )
    for key in (envvars.SLURM_STEP_NUM_TASKS, envvars.SLURM_NTASKS):
        tasks = _positive_int(env.get(key))
        if tasks is not None and tasks > 1 and env.get(envvars.PHALANX_SLURM) != "0":
            signs.append(f"{key}={tasks} (a SLURM job with several tasks)")
            break
    try:
        mpi = read_mpi_world(env)
    except MpiError:  # malformed MPI variables are reported where they are used, not here
        mpi = None
    if mpi is not None and mpi.size > 1:
        signs.append(f"{mpi.source}={mpi.rank}/{mpi.size} (an MPI launch)")
    return signs


def refuse_silent_world_of_one(env: Mapping[str, str], group_world_size: int | None = None) -> None:
    """Raise LonelyWorldError when a world of one was resolved but the env shows several processes."""
    signs = multi_process_signs(env, group_world_size)
    if not signs:
        return
    raise LonelyWorldError(
        "phalanx would run this process as a world of ONE (every process training on all the data), "
        f"but it sees a multi-process launch: {'; '.join(signs)}. HINT: start the script with "
        "`phalanx run` or `torchrun` (which set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
        "`srun python train.py` inside a SLURM step, `mpiexec -n N python train.py` with "
        "`pip install 'phalanx[mpi]'`, or phalanx.spawn(fn); or remove the stray variables "
        f"to really run one process ({envvars.PHALANX_SLURM}=0 ignores a SLURM allocation)."
    )


def _positive_int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw not in (None, "") else None
    except ValueError:
        return None
