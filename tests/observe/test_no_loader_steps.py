"""The live view of a loop no prepared loader feeds (data made in the loop): status.json, `phalanx
top` and the dashboard count its optimizer steps as a loader loop's batches are counted (from 0:
after N steps, step N - 1), show the phases the model's hooks measure, and say what they cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.observe.table import render

pytestmark = pytest.mark.dist
SCRIPT = Path(__file__).parent / "scripts" / "train_no_loader.py"
STEPS = 5


@pytest.mark.timeout(200)
def test_a_loop_without_a_prepared_loader_shows_its_optimizer_steps(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(tmp_path),
        str(SCRIPT),
        "--steps",
        str(STEPS),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "PHALANX_RUN_DIR": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads((tmp_path / "observe" / "status.json").read_text())
    assert status["step"] == STEPS, status  # the job's step: optimizer steps taken, as px.global_step says
    assert status["steps_count"] == "optimizer steps" and "no prepared loader" in status["not_measured"]
    for rank in status["ranks"]:
        assert rank["step"] == STEPS and rank["num_steps"] == STEPS, rank
        assert {"forward", "backward", "optimizer"} <= set(rank["phases"]) and "data" not in rank["phases"], rank
    screen = render(str(tmp_path), status)
    assert f"step {STEPS}" in screen and "not measured: data: no prepared loader" in screen
