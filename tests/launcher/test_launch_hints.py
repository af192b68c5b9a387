"""Hints for the common mistakes (issue 41 item 7), each through `phalanx run`: a launcher flag
written after the script, and init_process_group("nccl") on a machine without GPUs."""

import pytest
import torch

from tests.launcher.launch_helpers import SCRIPTS, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def test_a_launcher_flag_after_the_script_is_named_with_the_command_that_works():
    """The hint's command keeps the script's path as typed (issue 54: it dropped the directory, so
    pasting it failed); run from the script's grandparent, as `phalanx run examples/wine.py` is."""
    result = run_cli(["run", "scripts/uses_argparse.py", "--lr", "0.5", "--nproc-per-node", "2"], cwd=SCRIPTS.parent)
    assert result.returncode != 0
    assert "--nproc-per-node is a `phalanx run` flag, written after the script" in result.stderr, result.stderr
    assert (
        "HINT: put launcher flags before the script: phalanx run --nproc-per-node 2 scripts/uses_argparse.py --lr 0.5"
        in result.stderr
    ), result.stderr


def test_a_flag_the_script_takes_gets_no_hint(tmp_path):
    result = run_cli(["run", str(SCRIPTS / "uses_argparse.py"), "--lr", "0.5", "--bogus"], cwd=tmp_path)
    assert result.returncode != 0 and "phalanx run` flag" not in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_without_gpus_says_gloo_once_without_a_traceback(tmp_path):
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "nccl_on_cpu.py")], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "init_process_group('nccl') on rank 0: NCCL needs GPUs, and this machine has none" in result.stderr
    assert "HINT: on CPU use the 'gloo' backend" in result.stderr
    assert "Traceback" not in result.stderr and "NCCL built in" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 12, result.stderr
