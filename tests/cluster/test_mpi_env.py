"""`mpiexec python train.py`: MPI's variables mapped to torch's, as pure functions over a dict."""

from __future__ import annotations

import sys

import pytest

from phalanx.cluster.mpi import MpiError, read_mpi_world, store_address_over_mpi, torch_env_from_mpi
from phalanx.runtime.context import DistContext


def fixed_address(world):
    return "10.0.0.1", 23456


def test_open_mpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert torch_env_from_mpi(env, fixed_address) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "23456",
    }


def test_mpich_hydra_variables():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    world = read_mpi_world(env)
    assert (world.rank, world.size, world.local_rank, world.local_size, world.source) == (
        1,
        2,
        1,
        2,
        "PMI_RANK/PMI_SIZE",
    )


def test_local_rank_defaults_to_rank_modulo_local_size():
    world = read_mpi_world({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALNRANKS": "3"})
    assert (world.local_rank, world.local_size) == (2, 3)


def test_launcher_variables_and_a_single_process_derive_nothing():
    assert torch_env_from_mpi({"PMI_RANK": "0", "PMI_SIZE": "2", "RANK": "0"}, fixed_address) == {}
    assert torch_env_from_mpi({"PMI_RANK": "0", "PMI_SIZE": "1"}, fixed_address) == {}
    assert torch_env_from_mpi({}, fixed_address) == {}


def test_exported_master_address_is_used_without_mpi4py():
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29511"}

    def never(world):
        raise AssertionError("no exchange needed")

    result = torch_env_from_mpi(env, never)
    assert (result["MASTER_ADDR"], result["MASTER_PORT"]) == ("node1", "29511")


def test_rank_outside_size_is_reported():
    with pytest.raises(MpiError, match=r"PMI_RANK=2, MPI_LOCALRANKID=0 do not fit PMI_SIZE=2"):
        read_mpi_world({"PMI_RANK": "2", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})


def test_missing_mpi4py_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` raises ImportError
    world = read_mpi_world({"PMI_RANK": "0", "PMI_SIZE": "2"})
    with pytest.raises(MpiError, match=r"rank 0 of 2.*needs mpi4py.*pip install 'phalanx\[mpi\]'"):
        store_address_over_mpi(world)
    with pytest.raises(MpiError, match=r"pip install 'phalanx\[mpi\]'"):  # before any group is joined
        DistContext.from_env({"PMI_RANK": "0", "PMI_SIZE": "2"}, cpu=True)


def test_context_under_mpiexec_rendezvous_at_the_shared_address(monkeypatch):
    env = {
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "23999",
    }
    ctx = DistContext.from_env(env, cpu=True)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.init_method) == (1, 1, 2, "tcp://127.0.0.1:23999")
