"""Who this process is in the job: one explicit, immutable context built once from the env."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

from phalanx import config, envvars
from phalanx.cluster.slurm import torch_env_from_slurm


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
        """Read torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...), or SLURM's under plain srun."""
        env = os.environ if env is None else env
        slurm_env = torch_env_from_slurm(env)  # `srun python train.py`: no launcher variables
        if slurm_env:
            env = {**env, **slurm_env}
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
        device, backend = _pick_device(local_rank, cpu)
        return cls(rank, local_rank, world_size, local_world_size, node_rank, device, backend)


def launcher_settings(env: Mapping[str, str] | None = None) -> config.Layer:
    """The settings the launcher handed this process as PHALANX_* variables, checked."""
    return config.from_env(os.environ if env is None else env)


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
