"""examples/finetune_llm.py --tiny --moe under `--ep 2` (2 processes, half the experts each) logs the same
per-step losses and eval loss as one process with the same global batch: both commands as docs/moe.md
writes them."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune_llm.py"


def documented(prefix: str) -> list[str]:
    """The docs/moe.md command starting with `prefix` (its words after the script)."""
    line = next(
        line
        for line in (ROOT / "docs" / "moe.md").read_text().splitlines()
        if line.startswith(prefix) and "--moe" in line
    )
    return shlex.split(line)


def figures(stdout: str) -> list[float]:
    losses = [float(x) for x in re.findall(r"^step \d+ \| loss (\S+)", stdout, re.M)]
    return losses + [float(re.search(r"after \d+ steps: eval loss (\S+),", stdout).group(1))]


def test_moe_at_ep2_ends_where_one_process_does(tmp_path) -> None:
    ep = documented("phalanx run")
    script = ep.index("examples/finetune_llm.py")
    ep2 = run_cli(
        [*ep[1:script], "--run-dir", str(tmp_path / "ep2"), str(EXAMPLE), *ep[script + 1 :]], cwd=tmp_path, timeout=280
    )
    assert ep2.returncode == 0, ep2.stdout[-2000:] + ep2.stderr[-4000:]
    assert "strategy ddp, 2 process(es), ep 2;" in ep2.stdout
    one_args = documented("python examples/finetune_llm.py")[2:]
    one = subprocess.run(
        [sys.executable, str(EXAMPLE), *one_args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PHALANX_RUN_DIR": str(tmp_path / "one")},
    )
    assert one.returncode == 0, one.stderr[-4000:]
    got, want = figures(ep2.stdout), figures(one.stdout)
    assert len(got) == 7 and got == pytest.approx(want, rel=2e-4)
