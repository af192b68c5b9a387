"""`phalanx parity`, black-box: a loss multiplied by the world size and unsynced BatchNorm differ (exit 1)
at step 1, with the cause named; the correct script (the same BatchNorm, with --sync-batchnorm) agrees
on 1 and 2 processes (exit 0); a script that never calls px.backward or stops early
is refused (exit 2) after the one-process run."""

import re

import pytest

from tests.launcher.launch_helpers import SCRIPTS, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
SCRIPT = str(SCRIPTS / "parity_train.py")


def parity(tmp_path, *args: str):
    return run_cli(["parity", "--steps", "3", *args], cwd=tmp_path, timeout=280)


def rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"\s+\d+\s", line)]


def test_a_loss_multiplied_by_the_world_size_differs_at_step_1(tmp_path):
    result = parity(tmp_path, SCRIPT, "--bug", "loss")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "differ: first at step 1 " in result.stdout
    assert "a loss that scales with the world size: 2 x the one-process loss on 2 processes" in result.stdout
    assert "BatchNorm" not in result.stdout


def test_unsynced_batchnorm_differs_and_is_named(tmp_path):
    result = parity(tmp_path, SCRIPT, "--batchnorm")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "differ: first at step 1 " in result.stdout
    assert "BatchNorm layers without SyncBatchNorm (1 (BatchNorm1d))" in result.stdout
    assert "HINT: --sync-batchnorm" in result.stdout
    assert "scales with the world size" not in result.stdout


def test_a_correct_script_agrees_batchnorm_with_sync_batchnorm_and_dropout_off(tmp_path):
    # The script: Adam, a shuffled prepared loader, Dropout(0.3) and, here, BatchNorm made SyncBatchNorm.
    result = parity(tmp_path, "--sync-batchnorm", SCRIPT, "--batchnorm")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dropout is taken out of the comparison" in result.stdout
    assert len(rows(result.stdout)) == 3 and "<- differs" not in result.stdout
    assert "tolerance: a step agrees when |a - b| <= 0.0001 * |a| + 1e-06" in result.stdout
    assert "agree: 1 process and 2 processes train alike for 3 step(s)" in result.stdout
    assert (tmp_path / "runs" / "parity").is_dir()


def test_a_batch_size_set_from_dp_size_is_named_as_differing_global_batches(tmp_path):
    """It reported "none that phalanx can see": the one-process run took 16 samples a step, 2 processes 8."""
    result = parity(tmp_path, SCRIPT, "--batch-from-dp-size")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "the global batches differ: 16 samples per step in the one-process run against 8 on 2 processes"
        in result.stdout
    )
    assert "none that phalanx can see" not in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (("--no-backward",), "parity_train.py never called px.backward, so there is nothing to compare"),
        (
            ("--stop-after", "2"),
            "parity_train.py took only 2 optimizer steps (px.backward was called 2 times), "
            "fewer than --steps 3. HINT: pass --steps 2",
        ),
    ],
)
def test_a_script_without_backward_or_with_fewer_steps_is_refused(tmp_path, args, message):
    result = parity(tmp_path, SCRIPT, *args)
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr
    assert not list(tmp_path.glob("runs/parity/*/many.log"))  # the N-process run never started


def test_one_process_is_refused_before_anything_runs(tmp_path):
    result = parity(tmp_path, "--nproc-per-node", "1", SCRIPT)
    assert result.returncode == 2
    assert "parity compares 1 process with N >= 2, but the flags give 1 process" in result.stderr
    assert not (tmp_path / "runs").exists()
