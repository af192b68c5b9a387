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
