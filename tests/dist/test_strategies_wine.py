"""examples/wine.py under `phalanx run --strategy zero3` (and `--deepspeed` with ZeRO stage 3)
trains exactly as under ddp."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.dist.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def _run(*flags: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        *flags,
        "examples/wine.py",
        "--epochs",
        "30",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _result(out: str) -> tuple[str, str, str]:
    acc = re.search(r"test accuracy: ([0-9.]+) on 36 samples \(2 process\(es\), strategy (\w+)\)", out)
    loss = re.findall(r"epoch 29: loss ([0-9.]+)", out)
    assert acc and loss, out
    return acc.group(2), acc.group(1), loss[0]


def test_wine_zero3_and_deepspeed_stage3_reach_the_same_loss_and_accuracy_as_ddp(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "steps_per_print": 10}))
    ddp = _result(_run("--strategy", "ddp").stdout)
    zero3 = _result(_run("--strategy", "zero3").stdout)
    with_ds = _run("--deepspeed", str(ds))
    assert ddp[0] == "ddp" and zero3[0] == "zero3"
    assert zero3[1:] == ddp[1:] and float(zero3[1]) >= 0.9
    assert _result(with_ds.stdout) == zero3
    assert with_ds.stderr.count("have no phalanx equivalent and are NOT applied: steps_per_print") == 2  # per rank
