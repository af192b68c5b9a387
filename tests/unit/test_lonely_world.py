"""Never a silent world of one: each sign of a multi-process launch stops Phalanx's context."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.runtime.context import DistContext
from phalanx.runtime.world_check import LonelyWorldError, multi_process_signs, refuse_silent_world_of_one

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "env, sign",
    [
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 is set without RANK and WORLD_SIZE"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 (a SLURM job with several tasks)"),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}, "SLURM_STEP_NUM_TASKS=2 (a SLURM job with several tasks)"),
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
            "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE=1/2 (an MPI launch)",
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "3"}, "PMI_RANK/PMI_SIZE=0/3 (an MPI launch)"),
    ],
)
def test_each_sign_is_named(env, sign):
    assert multi_process_signs(env) == [sign]
    with pytest.raises(LonelyWorldError, match="world of ONE") as error:
        refuse_silent_world_of_one(env)
    assert sign in str(error.value) and "phalanx run" in str(error.value)


def test_world_size_above_one_and_an_initialised_group_are_signs():
    assert multi_process_signs({"WORLD_SIZE": "4"}) == ["WORLD_SIZE=4"]
    assert multi_process_signs({}, group_world_size=2) == ["a process group of 2 ranks is already initialised"]


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"},  # a launcher asked for one process
        {"WORLD_SIZE": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"},  # phalanx run --nproc-per-node 1 inside sbatch
        {"SLURM_NTASKS": "1", "PMI_SIZE": "1", "PMI_RANK": "0"},
        {"SLURM_NTASKS": "4", "PHALANX_SLURM": "0"},  # told to ignore the allocation
    ],
)
def test_a_real_world_of_one_passes(env):
    assert multi_process_signs(env) == []
    refuse_silent_world_of_one(env)


def test_context_refuses_local_rank_alone():
    with pytest.raises(LonelyWorldError, match=r"LOCAL_RANK=0 is set without RANK and WORLD_SIZE"):
        DistContext.from_env({"LOCAL_RANK": "0"})


def test_adopted_group_takes_rank_size_and_backend_from_the_group():
    ctx = DistContext.from_group(3, 4, "gloo", env={}, cpu=False)
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size, ctx.backend) == (3, 4, 3, 4, "gloo")
    assert ctx.adopted and ctx.device == torch.device("cpu")


def test_adopted_fake_group_sizes_a_rank_on_the_gpu_when_there_is_one(monkeypatch):
    # torch's fake backend (collectives do no work): one process sizes a rank of a larger world
    # (bench/memory.py --fake-world); its tensors go where a real run's would, the GPU if any
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert DistContext.from_group(1, 2, "fake", env={}).device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = DistContext.from_group(1, 2, "fake", env={}, gpu_count=1)
    assert (ctx.local_rank, ctx.device) == (0, torch.device("cuda", 0))
    assert DistContext.from_group(1, 2, "fake", env={}, cpu=True, gpu_count=1).device == torch.device("cpu")


def test_adopted_nccl_group_maps_ranks_to_local_gpus():
    ctx = DistContext.from_group(5, 8, "nccl", env={}, gpu_count=4)  # 2 nodes of 4 GPUs
    assert (ctx.local_rank, ctx.local_world_size, ctx.node_rank, ctx.device) == (1, 4, 1, torch.device("cuda", 1))
    ctx = DistContext.from_group(5, 8, "nccl", env={"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "6"}, gpu_count=4)
    assert (ctx.local_rank, ctx.local_world_size) == (3, 6)  # the launcher's variables win


def test_adopted_group_of_one_with_signs_is_refused():
    with pytest.raises(LonelyWorldError, match="WORLD_SIZE=2"):
        DistContext.from_group(0, 1, "gloo", env={"WORLD_SIZE": "2"})


@pytest.mark.dist
def test_plain_python_with_a_stray_local_rank_exits_with_the_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(LOCAL_RANK="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, "-c", "from phalanx import Phalanx; Phalanx()"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "LonelyWorldError: phalanx would run this process as a world of ONE" in proc.stderr
    assert "LOCAL_RANK=1 is set without RANK and WORLD_SIZE" in proc.stderr


def test_phalanx_adopts_an_existing_group_and_leaves_it_alive(tmp_path, monkeypatch):
    import torch.distributed as dist

    from phalanx import Phalanx
    from phalanx.runtime.process_group import destroy_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        px = Phalanx()
        assert px.ctx.adopted and (px.rank, px.world_size, px.strategy_name) == (0, 1, "single")
        destroy_process_group()  # phalanx's exit handler must not end a group it did not create
        assert dist.is_initialized()
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(LonelyWorldError, match=r"sees a multi-process launch: WORLD_SIZE=2"):
            Phalanx()
    finally:
        dist.destroy_process_group()
