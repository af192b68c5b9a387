"""examples/finetune_llm.py --pack at cp 2 (two processes, each holding half of every packed row)
logs the same per-step losses and eval loss as one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_llm.py"
ARGS = [
    "--tiny",
    "--limit",
    "200",
    "--seq-len",
    "64",
    "--batch-size",
    "4",
    "--pack",
    "--steps",
    "4",
    "--log-every",
    "1",
]


def figures(stdout: str) -> list[float]:
    losses = [float(x) for x in re.findall(r"^step \d+ \| loss (\S+)", stdout, re.M)]
    return losses + [float(re.search(r"after 4 steps: eval loss (\S+),", stdout).group(1))]


def test_packed_rows_at_cp2_train_as_one_process(tmp_path) -> None:
    cp2 = run_cli(
        ["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "cp2"), str(EXAMPLE), *ARGS, "--cp", "2"],
        cwd=tmp_path,
        timeout=280,
    )
    assert cp2.returncode == 0, cp2.stdout[-2000:] + cp2.stderr[-4000:]
    assert "2 process(es), cp 2" in cp2.stdout
    one = subprocess.run(
        [sys.executable, str(EXAMPLE), *ARGS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PHALANX_RUN_DIR": str(tmp_path / "one")},
    )
    assert one.returncode == 0, one.stderr[-4000:]
    got, want = figures(cp2.stdout), figures(one.stdout)
    assert len(got) == 5 and got == pytest.approx(want, rel=2e-4)
