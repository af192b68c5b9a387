"""examples/wine.py under `phalanx run --strategy zero3` trains exactly as under ddp."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.dist.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]


def _run(strategy: str) -> str:
    cmd = [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", "examples/wine.py",
           "--strategy", strategy, "--epochs", "30"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_wine_zero3_reaches_the_same_loss_and_accuracy_as_ddp():
    outputs = {s: _run(s) for s in ("ddp", "zero3")}
    found = {}
    for strategy, out in outputs.items():
        acc = re.search(r"test accuracy: ([0-9.]+) on 36 samples \(2 process\(es\), strategy (\w+)\)", out)
        loss = re.findall(r"epoch 29: loss ([0-9.]+)", out)
        assert acc and loss, out
        assert acc.group(2) == strategy
        found[strategy] = (acc.group(1), loss[0])
    assert found["zero3"] == found["ddp"]
    assert float(found["zero3"][0]) >= 0.9  # and it really learned the task
