"""`--dashboard` values the launcher refuses before any worker starts (exit 2, the fix named)."""

from __future__ import annotations

import socket

import pytest

from tests.launcher.launch_helpers import run_cli
from tests.observe.observe_helpers import SCRIPT


@pytest.mark.parametrize("flags, env", [(["--dashboard", "host:port"], {}), ([], {"PHALANX_DASHBOARD": "70000"})])
def test_a_bad_address_is_refused_from_the_flag_or_the_variable(tmp_path, flags, env):
    result = run_cli(["run", "--nproc-per-node", "2", *flags, str(SCRIPT)], env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "phalanx run: error:" in result.stderr and "expected [HOST:]PORT" in result.stderr, result.stderr


def test_an_address_in_use_is_refused_before_any_worker_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            ["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--dashboard", str(port), str(SCRIPT)],
            cwd=tmp_path,
        )
    assert result.returncode == 2, result.stderr
    assert f"--dashboard 127.0.0.1:{port}: cannot listen there" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "observe").exists()  # no worker ran


def test_the_address_reads_alike_from_a_flag_the_variable_and_yaml():
    from phalanx import config

    assert config.from_flags({"dashboard": "8765"})["dashboard"][0] == "127.0.0.1:8765"
    assert config.from_env({"PHALANX_DASHBOARD": "0.0.0.0:8765"})["dashboard"][0] == "0.0.0.0:8765"
    assert config.from_mapping({"dashboard": 8765}, "phalanx.yaml")["dashboard"][0] == "127.0.0.1:8765"
