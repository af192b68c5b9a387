"""Accelerate's own test scripts (accelerate/test_utils/scripts, installed with it), unmodified under
`phalanx run --nproc-per-node 2`: each joins one world of 2 (Accelerate's MULTI_CPU on gloo) and
prints every success line it prints under its own launcher. The ones that pass on CPU: test_script,
test_sync and test_ops. test_distributed_data_loop is not among them: its uneven-inputs join is
Accelerate's multi-GPU feature (on CPU it warns "only supported for multi-GPU" and the ranks wait on
each other's all-reduce), under any launcher. test_cli joins no group (it counts accelerators): each
process prints its line and phalanx says they ran as separate worlds."""

import importlib.util
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(420)]

SCRIPTS = Path(importlib.util.find_spec("accelerate.test_utils.scripts").origin).parent
ONE_WORLD = ("Distributed environment: DistributedType.MULTI_CPU  Backend: gloo", "Num processes: 2")
SUCCESS = {
    "test_script": (
        "All rng are properly synched.",
        "Shuffled central dataloader passing.",
        "Training yielded the same results on one CPU or distributed setup with batch split.",
        "**Test reinstantiated state**",
    ),
    "test_sync": (
        "**Test Distributed `no_sync` context manager**",
        "**Test Distributed `no_sync` context manager with multiple forwards**",
        "`split_batches=False`, `dispatch_batches=False`, `sync_each_batch=False`**",
    ),
    "test_ops": ("testing gather_object", "testing pad_across_processes", "testing sending tensors across devices"),
}


@pytest.mark.parametrize("name", sorted(SUCCESS))
def test_accelerates_own_test_script_passes_as_one_world(name, tmp_path):
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / f"{name}.py")], cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    said = result.stdout + result.stderr
    for line in SUCCESS[name]:
        assert line in said, (line, said[-4000:])
    if name != "test_sync":  # test_sync prints no state
        for line in ONE_WORLD:
            assert line in said, (line, said[-4000:])
    assert "Num processes: 1" not in said and "DistributedType.NO" not in said


def test_accelerates_cli_script_runs_on_each_process_and_is_said_to_join_no_world(tmp_path):
    """test_cli.py only counts the accelerators (it never joins a group, under accelerate launch too):
    each process prints its line, and phalanx says the processes ran as separate worlds of one."""
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "test_cli.py")], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("Successfully ran on 0 GPUs") == 2, result.stdout
    assert "never joined a process group of 2: they ran as 2 separate worlds of one" in result.stderr
