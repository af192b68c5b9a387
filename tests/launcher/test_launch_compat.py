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


def plain_linear_weights(steps: int, rows_per_step: int) -> list[float]:
    """fabric_launch_script.py's loop in one process, no Fabric: each step's batch is both ranks' rows."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    losses = []
    for step in range(steps):
        rows = slice(step * rows_per_step, (step + 1) * rows_per_step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.weight.tolist()


def test_a_fabric_script_that_calls_launch_joins_one_world(tmp_path):
    """Fabric's documented form (`Fabric(accelerator="cpu", devices=2, strategy="ddp")` and
    `fabric.launch()`, what `python train.py` and torchrun run) failed under `phalanx run` with
    "launched through the CLI ... Calling .launch() again is not allowed" (phalanx handed it
    `fabric run`'s LT_CLI_USED); now one world of 2, equal to one process on the joined batches."""
    out = tmp_path / "result.json"
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "fabric_launch_script.py"), str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = json.loads(out.read_text())
    losses, weight = plain_linear_weights(steps=4, rows_per_step=8)
    assert got["world_size"] == 2 and len(got["losses"]) == 4
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    assert got["weight"][0] == pytest.approx(weight[0], rel=1e-5, abs=1e-6)


def test_an_accelerate_partial_state_script_joins_one_world(tmp_path):
    """Accelerate's docs' inference with `PartialState()` alone ran as two silent worlds of one on CPU
    (each process saw num_processes 1 and all four items); now each sees 2 and its half."""
    result = run_cli(
        ["run", "--nproc-per-node", "2", str(SCRIPTS / "partial_state_script.py"), str(tmp_path)], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [
        {"num_processes": 2, "index": 0, "part": ["a", "b"]},
        {"num_processes": 2, "index": 1, "part": ["c", "d"]},
    ]


def test_file_is_absolute_as_under_python(tmp_path):
    """`python job/script.py` gives the script an absolute `__file__`; under `phalanx run` it was
    'job/file_after_chdir.py', so a path built from it broke after the script's os.chdir."""
    (tmp_path / "job").mkdir()
    (tmp_path / "elsewhere").mkdir()
    script = tmp_path / "job" / "file_after_chdir.py"
    script.write_text((SCRIPTS / "file_after_chdir.py").read_text())
    result = run_cli(["run", "--nproc-per-node", "2", "job/file_after_chdir.py", "elsewhere"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        seen = json.loads((tmp_path / "elsewhere" / f"rank{rank}.json").read_text())
        assert seen == {"file": str(script), "first": script.read_text().splitlines()[0]}
