"""`phalanx run` flags meeting phalanx.cluster: SLURM defaults, elastic ranges, rendezvous settings."""

import argparse

import pytest

from phalanx.launch.rendezvous import NodeSetup
from phalanx.cluster.network import Route
from phalanx.launch import agent, run_command
from phalanx.launch.spec import LaunchError, LaunchSpec


def _parse(argv):
    parser = argparse.ArgumentParser()
    run_command.configure(parser)
    return parser.parse_args(argv)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    return "train.py"


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("SLURM_") or key == "PHALANX_SLURM":
            monkeypatch.delenv(key)
    return monkeypatch


def _slurm(monkeypatch, node_id, **extra):
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_GPUS_ON_NODE": "4",
        **extra,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_srun_phalanx_run_takes_everything_from_slurm(script, clean_env, capsys):
    _slurm(clean_env, 1)
    spec = run_command.spec_from_args(_parse([script]))
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port, spec.nproc_per_node, spec.rdzv_id) == (
        2,
        1,
        "gpu01",
        15000 + 4242,
        4,
        "slurm-4242",
    )
    assert "phalanx: SLURM job 4242: node 1 of 2, master gpu01:19242, 4 process(es) per node" in capsys.readouterr().err


def test_explicit_master_and_nproc_win_within_the_allocation(script, clean_env):
    _slurm(clean_env, 0)
    spec = run_command.spec_from_args(
        _parse(["--master-addr", "10.0.0.9", "--master-port", "31000", "--nproc-per-node", "2", script])
    )
    assert (spec.master_addr, spec.master_port, spec.nproc_per_node) == ("10.0.0.9", 31000, 2)


def test_slurm_mismatch_is_reported_by_phalanx_run(script, clean_env, capsys):
    _slurm(clean_env, 0)
    code = run_command.main(_parse(["--nproc-per-node", "8", script]))
    assert code == 2
    assert "phalanx run: error: --nproc-per-node 8 but SLURM allocated 4 GPU(s)" in capsys.readouterr().err


def test_phalanx_slurm_0_ignores_the_allocation(script, clean_env):
    _slurm(clean_env, 1, PHALANX_SLURM="0")
    spec = run_command.spec_from_args(_parse([script]))
    assert (spec.nnodes, spec.node_rank, spec.master_addr) == (1, 0, None)


def test_elastic_range_needs_c10d(script, clean_env):
    with pytest.raises(LaunchError, match=r"--nnodes 1:4 is an elastic range.*--rdzv-backend c10d"):
        run_command.spec_from_args(_parse(["--nnodes", "1:4", script]))
    spec = run_command.spec_from_args(
        _parse(["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", script])
    )
    assert (spec.min_nnodes, spec.nnodes) == (1, 4)


def test_bad_nnodes_and_timeout(script, clean_env):
    with pytest.raises(LaunchError, match="--nnodes two: expected N or MIN:MAX"):
        run_command.spec_from_args(_parse(["--nnodes", "two", script]))
    with pytest.raises(LaunchError, match="--rdzv-timeout -1: expected a number of seconds > 0"):
        run_command.spec_from_args(_parse(["--rdzv-timeout", "-1", script]))


def _plan(is_host):
    route = Route("10.250.0.1", ("10.250.0.1",), "10.250.0.1", "10.250.0.2", "veth1", is_host)
    return NodeSetup("10.250.0.1", 29400, route, "veth1", "10.250.0.2", is_host, {})


def test_c10d_settings_carry_is_host_local_addr_and_timeouts():
    spec = LaunchSpec(
        target="t.py", nnodes=4, min_nnodes=2, rdzv_backend="c10d", rdzv_endpoint="10.250.0.1:29400", rdzv_timeout=30
    )
    settings = agent.rendezvous_settings(spec, _plan(False))
    assert settings["local_addr"] == "10.250.0.2"
    assert settings["rdzv_configs"] == {"join_timeout": 30, "read_timeout": 15, "is_host": False}
    assert settings["run_id"] == agent.MULTINODE_RUN_ID  # the same on every node, unlike a per-node uuid


def test_static_multi_node_settings_carry_the_timeout():
    spec = LaunchSpec(
        target="t.py", nnodes=2, node_rank=1, master_addr="10.250.0.1", master_port=29400, rdzv_timeout=20
    )
    settings = agent.rendezvous_settings(spec, _plan(False))
    assert settings["rdzv_configs"] == {"rank": 1, "timeout": 20}
    assert settings["local_addr"] == "10.250.0.2"
