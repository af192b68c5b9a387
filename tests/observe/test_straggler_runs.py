"""Straggler attribution on real 2-process jobs: a planted input straggler (rank 1's loader sleeps)
and a compute straggler (rank 1's forward takes longer) are named with that phase within 100 steps;
a balanced run of 500 steps names nobody."""

from __future__ import annotations

import json
import re

import pytest

from tests.observe.observe_helpers import phalanx_run, straggler_lines

pytestmark = pytest.mark.dist
NAMED = re.compile(
    r"straggler: rank 1 \(host \S+, local rank 1\) slowest in (\d+) % of the last (\d+) steps: "
    r"\+(\d+) ms/step in (\w+)$"
)


def run(tmp_path, *args: str, timeout: float = 180) -> tuple[str, str]:
    proc = phalanx_run(tmp_path, *args)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out, err


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["data", "forward"])
def test_a_planted_straggler_is_named_with_its_phase_within_100_steps(tmp_path, phase):
    _, err = run(tmp_path, "--steps", "150", "--straggler", phase, "--delay-ms", "40")
    lines = straggler_lines(tmp_path)
    assert lines, f"nobody named; stderr:\n{err[-3000:]}"
    first = lines[0]
    match = NAMED.match(first["message"])
    assert match, first
    share, _, ms, named_phase = match.groups()
    assert named_phase == phase and int(share) >= 80 and 30 <= int(ms) <= 80, first
    assert first["step"] < 100, first
    assert first["message"] in err  # logged as a warning too
    assert "step anatomy (ms per step):" in err  # the exit table
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sent = [row for row in rows if "straggler/rank" in row]  # what the trackers got
    assert sent[0]["straggler/rank"] == 1 and sent[0]["straggler/ms_per_step"] >= 30, sent


@pytest.mark.timeout(300)
def test_a_balanced_run_of_500_steps_names_nobody(tmp_path):
    _, err = run(tmp_path, "--steps", "500", timeout=280)
    assert straggler_lines(tmp_path) == [], err[-3000:]
    assert "straggler:" not in err
