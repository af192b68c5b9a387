"""Scripts written for other tools run unmodified under `phalanx run`."""

import json

import pytest

from tests.launcher.launch_helpers import SCRIPTS, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def test_unmodified_accelerate_script_runs_on_two_ranks(tmp_path):
    out = tmp_path / "result.json"
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "accelerate_script.py"), str(out)])
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == {"num_processes": 2, "steps": 4, "ranks_agree": True}


def test_a_torch_script_importing_transformers_is_no_accelerate_script(tmp_path):
    """Accelerate is told apart by an Accelerator made, not by a module imported: the flag that
    reached no script is named, with the plain-torch reason."""
    result = run_cli(
        ["run", "--nproc-per-node", "2", "--mixed-precision", "bf16", str(SCRIPTS / "torch_imports_transformers.py")],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (line,) = [l for l in result.stderr.splitlines() if "had no effect" in l]
    assert "--mixed-precision bf16 had no effect" in line and "a plain torch script" in line, line
    assert "Accelerate" not in line, line


def test_an_accelerate_script_is_still_told_apart(tmp_path):
    out = tmp_path / "result.json"
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--mixed-precision",
            "no",
            "--strategy",
            "zero3",
            str(SCRIPTS / "accelerate_script.py"),
            str(out),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (line,) = [l for l in result.stderr.splitlines() if "had no effect" in l]
    assert "--strategy zero3 had no effect" in line and "it used Accelerate" in line, line


def test_a_fabric_script_joins_one_world_with_what_fabric_run_gives(tmp_path):
    """Lightning Fabric, as its docs write a script for `fabric run`: was 2 worlds of one (8 steps
    each, each rank its own main process) and --mixed-precision said to have had no effect; now one
    world of 2, bf16-mixed, and only the strategy named, with Fabric's reason."""
    out = tmp_path / "result.json"
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--mixed-precision",
            "bf16",
            "--strategy",
            "zero3",
            str(SCRIPTS / "fabric_script.py"),
            str(out),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == {"world_size": 2, "steps": 4, "precision": "bf16-mixed", "ranks_agree": True}
    (line,) = [l for l in result.stderr.splitlines() if "had no effect" in l]
    assert line.startswith("phalanx run: warning: --strategy zero3 had no effect") and "Lightning Fabric" in line, line
    assert "separate worlds" not in result.stderr
