"""`phalanx plan`'s activation estimate (a meta-device forward) against the resident memory of a
real CPU process, with and without activation checkpointing; hsdp's row; bad input."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.plan import activations
from phalanx.plan import command as plan_command
from phalanx.model import memory
from phalanx.strategies.plan import presets
from tests.plan_reference import by_preset

ROOT = Path(__file__).resolve().parents[2]


def _measure(*args: str) -> dict:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.activation_rss", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _within(estimate: int, measured: int, tolerance: float = 0.1) -> None:
    assert abs(estimate - measured) <= tolerance * measured, (estimate, measured)


def test_estimate_without_checkpointing_is_within_10_percent_of_resident_memory():
    m = _measure()
    assert m["after_forward"] > 500 * 2**20  # the activations dominate what is measured
    _within(m["full"], m["after_forward"])
    _within(m["peak_full"], m["peak"])


def test_estimate_with_checkpointing_is_within_10_percent_of_resident_memory():
    m = _measure("ac")
    assert m["after_forward"] < m["full"] / 5  # checkpointing really dropped the blocks' activations
    _within(m["kept_checkpointed"], m["after_forward"])
    _within(m["peak_checkpointed"], m["peak"])


def test_hsdp_shards_within_a_node_and_replicates_across():
    sizes = [memory.ParamSize("w", (8, 4), 4)]
    table = by_preset(sizes, world_size=4, local_world_size=2)
    assert [r.params for r in table["hsdp"]] == [16 * 4] * 4  # half of 32 elements on each rank
    assert [r.params for r in table["zero3"]] == [8 * 4] * 4  # a quarter
    with pytest.raises(ValueError, match="does not cover the 4 data-parallel ranks"):  # the plan refuses it
        presets.build("hsdp", presets.asking(), world_size=4, local_world_size=4, shard_size=3)


def test_plan_command_prints_hsdp_and_activations_with_checkpointing(capsys):
    parser = argparse.ArgumentParser()
    plan_command.configure(parser)
    model = "tests.unit.activation_rss:Net"
    args = parser.parse_args(
        [
            model,
            "--world-size",
            "4",
            "--nproc-per-node",
            "2",
            "--budget",
            "1GB",
            "--input",
            "256x256",
            "--activation-checkpointing",
        ]
    )
    assert plan_command.main(args) == 0
    out = capsys.readouterr().out
    hsdp = next(line for line in out.splitlines() if line.strip().startswith("hsdp 2x2"))
    assert hsdp.split()[-1] == "0.50"
    assert (
        "activations per rank, any strategy, with activation checkpointing of the 4 blocks: "
        "64.6 MiB after the forward, 305.1 MiB at the backward's peak (722.6 MiB without it)"
    ) in out


def test_bad_input_and_checkpointing_without_input_are_named(capsys):
    with pytest.raises(ValueError, match=r"cannot read --input '16by32'; HINT: write the per-rank batch"):
        activations.parse_input("16by32")
    assert activations.parse_input("16x3x8x8:float32") == ((16, 3, 8, 8), __import__("torch").float32)
    parser = argparse.ArgumentParser()
    plan_command.configure(parser)
    args = parser.parse_args(["tests.unit.activation_rss:Net", "--world-size", "2", "--activation-checkpointing"])
    assert plan_command.main(args) == 2  # one line naming the fix, no traceback
    assert (
        "phalanx plan: error: --activation-checkpointing changes the activation estimate, which needs --input "
        "SHAPE" in capsys.readouterr().err
    )
