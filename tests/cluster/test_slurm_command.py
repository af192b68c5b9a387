"""`phalanx slurm`: the batch script it prints/writes, and its errors."""

import sys

import pytest

from phalanx import cli

WINE_ARGS = ["--epochs", "5", "two words"]


def _run(capsys, argv, cwd, monkeypatch):
    monkeypatch.chdir(cwd)
    code = cli.main(["slurm", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def test_dry_run_prints_a_multi_node_gpu_script(capsys, monkeypatch, script, tmp_path):
    code, out, err = _run(
        capsys,
        [
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--time",
            "02:00:00",
            "--partition",
            "gpu",
            "--strategy",
            "zero3",
            "--dry-run",
            "train.py",
            *WINE_ARGS,
        ],
        tmp_path,
        monkeypatch,
    )
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [l for l in lines if l.startswith("#SBATCH")] == [
        "#SBATCH --job-name=train",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=02:00:00",
        f"#SBATCH --chdir={tmp_path}",
        "#SBATCH --output=logs/%x-%j.out",
        "#SBATCH --partition=gpu",
        "#SBATCH --signal=USR1@120",  # preempt_grace: the workers save a step before the time limit
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",  # a requeued run appends to its logs
    ]
    assert "set -euo pipefail" in lines and "mkdir -p logs" in lines
    assert lines[-3:] == [
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append \\",
        "  --output=logs/%x-%j-node%n.out \\",
        f"  {sys.executable} -m phalanx run --nproc-per-node 4 --strategy zero3 {script} --epochs 5 'two words'",
    ]
    assert not (tmp_path / "train.sbatch").exists()  # --dry-run writes nothing


def test_cpu_job_asks_for_no_gpus_and_leaves_nproc_auto(capsys, monkeypatch, script, tmp_path):
    code, out, _ = _run(
        capsys, ["--dry-run", "--job-name", "wine-cpu", "--cpus-per-task", "2", "train.py"], tmp_path, monkeypatch
    )
    assert code == 0
    assert "--gpus-per-node" not in out
    assert "#SBATCH --cpus-per-task=2" in out and "#SBATCH --nodes=1" in out and "#SBATCH --job-name=wine-cpu" in out
    assert f"-m phalanx run --nproc-per-node auto {script}\n" in out


def test_writes_the_script_and_says_how_to_submit(capsys, monkeypatch, script, tmp_path):
    code, out, _ = _run(capsys, ["--nodes", "3", "-o", "job.sh", "train.py"], tmp_path, monkeypatch)
    assert code == 0
    assert out.strip() == "phalanx slurm: wrote job.sh; submit with: sbatch job.sh"
    assert "#SBATCH --nodes=3" in (tmp_path / "job.sh").read_text()
    assert (tmp_path / "logs").is_dir()  # SLURM opens the batch log before the script can mkdir it


def test_submit_without_sbatch_says_so_and_keeps_the_script(capsys, monkeypatch, script, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    code, _, err = _run(capsys, ["--submit", "train.py"], tmp_path, monkeypatch)
    assert code == 1
    assert "sbatch not found on PATH; the script is in train.sbatch" in err
    assert (tmp_path / "train.sbatch").exists()


def test_submit_runs_sbatch_on_the_script(capsys, monkeypatch, script, tmp_path):
    fake = tmp_path / "sbatch"
    fake.write_text('#!/bin/sh\necho "Submitted batch job 42 ($1)"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, _ = _run(capsys, ["--submit", "train.py"], tmp_path, monkeypatch)
    assert (code, out) == (0, "Submitted batch job 42 (train.sbatch)\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--time", "2 hours", "train.py"], "--time '2 hours' is not a SLURM time"),
        (["--nodes", "0", "train.py"], "--nodes must be at least 1, got 0"),
        (["missing.py"], "training script 'missing.py' not found"),
    ],
)
def test_bad_input_is_refused(capsys, monkeypatch, script, tmp_path, argv, message):
    code, _, err = _run(capsys, ["--dry-run", *argv], tmp_path, monkeypatch)
    assert code == 2 and message in err
