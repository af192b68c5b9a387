"""Ranks started without `phalanx run`: mp.spawn with the script's own process group,
phalanx.spawn from a script and from a Jupyter kernel, and mpiexec. Each must give Phalanx() a
world of 2 with disjoint shards covering the data, and one print."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import ROOT, free_port
from tests.dist.spawn_workloads import NUM_SAMPLES, PRINTED

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.dist


def script_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]),
    )
    return env


def run(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def check_two_rank_reports(reports: list[dict], printed: str) -> None:
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["world_size"] == 2 for r in reports)
    assert all(r["strategy"] == "ddp" for r in reports)  # auto picked ddp: a real multi-rank run
    shards = [set(r["seen"]) for r in reports]
    assert len(reports[0]["seen"]) == len(reports[1]["seen"]) == NUM_SAMPLES // 2
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(NUM_SAMPLES))
    assert printed.count(PRINTED) == 1, printed


def read_reports(out: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def test_mp_spawn_with_own_process_group_is_adopted(tmp_path):
    proc = run([sys.executable, str(SCRIPTS / "own_group.py"), str(tmp_path / "init"), str(tmp_path)], tmp_path)
    reports = read_reports(tmp_path)
    check_two_rank_reports(reports, proc.stdout)
    assert [r["local_rank"] for r in reports] == [0, 1]  # no LOCAL_RANK under mp.spawn: rank % local size
    assert all(r["group_alive"] for r in reports)  # phalanx's exit handlers left the script's group alone


def test_an_adopted_group_ended_by_the_script_is_no_lost_store_for_the_watchdog(tmp_path):
    """Rank 0 hosts the script's store and exits first; rank 1 lingers after destroy_process_group()."""
    proc = run([sys.executable, str(SCRIPTS / "own_group_late_exit.py"), str(free_port())], tmp_path)
    assert sorted(proc.stdout.split("\n")[-3:-1]) == ["rank 0 left", "rank 1 left"], proc.stdout
    assert "lost the rendezvous store" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_phalanx_spawn_from_a_script(tmp_path, start_method):
    proc = run([sys.executable, str(SCRIPTS / "spawn_job.py"), str(tmp_path), start_method], tmp_path)
    reports = json.loads((tmp_path / "reports.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1]  # returned in rank order
    check_two_rank_reports(reports, proc.stdout)
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("phalanx: rank 1 (local rank 1 on node 0) failed with exit code 1"), error
    assert 'raise ValueError("rank one cannot go on")' in error and "ValueError: rank one cannot go on" in error
    assert "run_in_worker" not in error  # the user's frames only, not phalanx's wrapper


NOTEBOOK_CELLS = [
    """import torch
from torch.utils.data import DataLoader, TensorDataset
import phalanx
from phalanx import Phalanx

def shards(n):
    px = Phalanx()
    loader = px.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=2, shuffle=True))
    seen = [i for (batch,) in loader for i in batch.tolist()]
    px.print("%s")
    return {"rank": px.rank, "world_size": px.world_size, "seen": seen, "strategy": "ddp"}"""
    % PRINTED,
    "results = phalanx.spawn(shards, %d)\nprint('RESULTS', results)" % NUM_SAMPLES,
]


def test_phalanx_spawn_in_a_jupyter_kernel(tmp_path, monkeypatch):
    from tests.notebook import run_cells

    stdout = run_cells(NOTEBOOK_CELLS, tmp_path, monkeypatch, script_env())
    results_line = next(line for line in stdout.splitlines() if line.startswith("RESULTS "))
    reports = eval(results_line[len("RESULTS ") :])  # the repr of a list of dicts of ints and strings
    check_two_rank_reports(reports, stdout)


def mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.mark.skipif(
    mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason="no MPI: pip install mpich mpi4py (the `mpi` and `test` extras)",
)
def test_mpiexec_gives_a_world_of_two(tmp_path):
    proc = run([mpiexec(), "-n", "2", sys.executable, str(SCRIPTS / "mpi_job.py"), str(tmp_path)], tmp_path)
    reports = read_reports(tmp_path)
    check_two_rank_reports(reports, proc.stdout)
    assert [r["local_rank"] for r in reports] == [0, 1]  # MPI_LOCALRANKID


def test_wine_mp_spawn_example_trains_each_rank_on_its_half(tmp_path):
    pytest.importorskip("sklearn")
    proc = run([sys.executable, str(ROOT / "examples" / "wine_mp_spawn.py"), "--epochs", "2"], tmp_path)
    assert proc.stdout.count("2 ranks (strategy ddp) saw [71, 71] of 142 training samples per epoch") == 1, proc.stdout
    assert proc.stdout.count("epoch 1: loss") == 1
