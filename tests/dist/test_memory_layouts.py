"""ZeRO keeps its promise in resident memory, not only in bytes counted: each layout's per-rank
resident anonymous memory (RssAnon) at rest and at a step's peak, measured by bench/memory.py on a transformers Llama (2 CPU
processes, one `phalanx run` per layout), in the order the byte count gives; and `phalanx plan`
(= px.memory_report) within 15% of what each layout measures at rest, so its advice holds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.plan.command import preference

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "hsdp", "tp2")
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    done = subprocess.run([sys.executable, "bench/memory.py", "--layouts", *LAYOUTS, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def _whole(measured) -> str:
    """Every layout's whole run (at rest, malloc's bytes in use, peak, report) and the plan, as one
    string: pytest shortens a message that is not a string to a line, which hid the runs before."""
    return json.dumps(measured, indent=1)


def _figure(measured, key):
    return {name: runs[0][key] for name, runs in measured["runs"].items()}


def test_at_rest_each_stage_holds_less_than_the_one_before(measured):
    rest = _figure(measured, "at_rest")
    # bytes: ddp 1.00, zero1 0.75, zero2 and zero3 0.50 (zero2 reshards after the backward, so at rest
    # it holds what zero3 does); measured (RssAnon) 0.79 / 0.54 / 0.54 with freed host memory given back
    assert rest["zero1"] < 0.92 * rest["ddp"], _whole(measured)
    assert rest["zero2"] < 0.85 * rest["zero1"], _whole(measured)
    # zero2 and zero3 hold the same bytes at rest: malloc's bytes in use agree (82.8 / 82.8 MiB); resident
    # pages differ by where those bytes landed, a few MiB between runs (4.0 MiB over zero2 in a CI run)
    used = _figure(measured, "in_use")
    assert used["zero3"] < 1.02 * used["zero2"], _whole(measured)
    assert rest["zero3"] < rest["zero2"] + 8 * 2**20 and rest["zero3"] < 0.72 * rest["ddp"], _whole(measured)


def test_no_stage_peaks_above_ddp(measured):
    # measured (RssAnon) zero1 0.79, zero2 0.83-0.87, zero3 0.77-0.80 (zero2/zero3 0.79/0.74 before
    # gradients were reduced by an all-to-all into a second buffer, 0.82/0.77 before a step's buffers
    # were reused, one unused kept: two kept took zero2 to 0.92; zero1 1.01 before it gathered in
    # place in small buckets); runs repeat within ~4 MiB of each other
    peak = _figure(measured, "peak")
    for name in ("zero1", "zero2", "zero3"):
        assert peak[name] < 0.95 * peak["ddp"], _whole(measured)


def test_memory_report_is_the_plan(measured):
    for name, runs in measured["runs"].items():
        assert runs[0]["report"] == measured["plan"][name], name


def test_the_plan_is_within_15_percent_of_what_each_layout_holds_at_rest(measured):
    # measured (RssAnon) / plan: ddp 1.00, zero1 1.05, zero2/zero3/hsdp 1.07, tp2 1.08; in RSS the
    # libraries' file pages added 20-40 MiB that varied with the page cache (a fresh venv failed here)
    rest = _figure(measured, "at_rest")
    for name in LAYOUTS:
        # the whole run in the message: whether malloc's bytes in use moved with the resident ones
        assert abs(measured["plan"][name] - rest[name]) <= 0.15 * rest[name], f"{name}: " + _whole(measured)


def test_the_layout_the_plan_advises_for_a_budget_is_the_one_that_fits(measured):
    # phalanx plan suggests the first of ddp, zero1, zero2, zero3 whose figure fits the budget;
    # at budgets between the measured figures, the plan's choice is the one the measurements make
    rest = _figure(measured, "at_rest")
    values = sorted(rest[name] for name in preference())
    budgets = [(a + b) / 2 for a, b in zip(values, values[1:]) if b > 1.1 * a] + [values[-1] * 1.05]
    for budget in budgets:
        by_plan = next((n for n in preference() if measured["plan"][n] <= budget), None)
        by_measure = next((n for n in preference() if rest[n] <= budget), None)
        assert by_plan == by_measure, f"budget {budget}: " + _whole(measured)


def test_a_fake_world_measures_what_two_processes_hold(measured, tmp_path):
    """bench/memory.py --fake-world (each rank alone, collectives doing no work: how one GPU sizes a
    2-GPU layout, tests/gpu) reads within 10% of the real 2-process run at rest, layout by layout."""
    out = tmp_path / "fake.json"
    done = subprocess.run([sys.executable, "bench/memory.py", "--fake-world", "--layouts", "ddp", "zero1", "zero3", "tp2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    fake = {name: runs[0]["at_rest"] for name, runs in json.loads(out.read_text())["runs"].items()}
    real = _figure(measured, "at_rest")
    assert all(abs(fake[name] - real[name]) <= 0.1 * real[name] for name in fake), f"fake world {fake}: " + _whole(measured)
