"""ZeRO keeps its promise in what a process holds, not only in bytes counted: each layout's per-rank
live bytes (malloc's bytes in use) at rest, with resident anonymous memory (RssAnon) beside them and
at a step's peak, measured by bench/memory.py on a transformers Llama (2 CPU processes, one
`phalanx run` per layout), in the order the byte count gives; and `phalanx plan` (= px.memory_report)
within 15% of what each layout holds at rest, so its advice holds. Live bytes, because resident
memory also depends on where freed blocks land, which `host_mmap_threshold` decides (issue 44: no
setting trades speed for a reading)."""

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
    done = subprocess.run(
        [sys.executable, "bench/memory.py", "--layouts", *LAYOUTS, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def _whole(measured) -> str:
    """Every layout's whole run (at rest, malloc's bytes in use, peak, report) and the plan, as one
    string: pytest shortens a message that is not a string to a line, which hid the runs before."""
    return json.dumps(measured, indent=1)


def _figure(measured, key):
    return {name: runs[0][key] for name, runs in measured["runs"].items()}


def test_at_rest_each_stage_holds_less_than_the_one_before(measured):
    # read from what is live (malloc's bytes in use), resident memory beside it in the message: ddp and
    # zero1 run at glibc's default (host_mmap_threshold auto), where freed blocks stay in glibc's heap,
    # zero2/zero3 with freed blocks given back. bytes: ddp 1.00, zero1 0.75, zero2 and zero3 0.50
    # (zero2 reshards after the backward, so at rest it holds what zero3 does); measured in use 0.81 /
    # 0.58 / 0.58 (142.2, 115.5, 82.9, 82.9 MiB), RssAnon 0.83 / 0.52 / 0.52
    used = _figure(measured, "in_use")
    assert used["zero1"] < 0.92 * used["ddp"], _whole(measured)
    assert used["zero2"] < 0.85 * used["zero1"], _whole(measured)
    assert used["zero3"] < 1.02 * used["zero2"] and used["zero3"] < 0.72 * used["ddp"], _whole(measured)
    # resident pages differ from the bytes by where those bytes landed, a few MiB between runs
    rest = _figure(measured, "at_rest")
    assert rest["zero3"] < rest["zero2"] + 8 * 2**20 and rest["zero3"] < 0.72 * rest["ddp"], _whole(measured)


def test_no_stage_peaks_above_ddp(measured):
    # measured (RssAnon) zero1 0.94, zero2 0.79, zero3 0.73 with ddp and zero1 at glibc's default
    # (0.79 / 0.83-0.87 / 0.77-0.80 when every layout gave freed memory back: ddp's and zero1's peaks
    # then read 157 and 125 MiB, now 170 and 160: glibc's heap keeps what a step freed for the next);
    # zero2/zero3's include a second buffer of a block's gradients while it is reduced; runs repeat
    # within ~4 MiB of each other
    peak = _figure(measured, "peak")
    assert peak["zero1"] < peak["ddp"], _whole(measured)
    for name in ("zero2", "zero3"):
        assert peak[name] < 0.95 * peak["ddp"], _whole(measured)


def test_memory_report_is_the_plan(measured):
    for name, runs in measured["runs"].items():
        assert runs[0]["report"] == measured["plan"][name], name


def test_the_plan_is_within_15_percent_of_what_each_layout_holds_at_rest(measured):
    # read from what is live: malloc's bytes in use less what every layout holds beside its model
    # state (ddp's in use less ddp's plan: 19.9 MiB of Python objects, torch's and gloo's own, the same
    # in every layout within 5 MiB); measured / plan: ddp 1.00, zero1 1.04, zero2/zero3/hsdp 1.01,
    # tp2 1.08. Resident memory moves with where freed blocks land (tp2 at glibc's default: 79.2 MiB
    # for a plan of 66.2, 1.20; its bytes in use 91.2 MiB in every run), and in RSS the libraries'
    # file pages added 20-40 MiB that varied with the page cache (a fresh venv failed here)
    used = _figure(measured, "in_use")
    beside = used["ddp"] - measured["plan"]["ddp"]
    for name in LAYOUTS:
        live = used[name] - beside
        # the whole run in the message: at rest, in use, peak and the plan of every layout
        assert abs(measured["plan"][name] - live) <= 0.15 * live, f"{name}: " + _whole(measured)
    rest = _figure(measured, "at_rest")  # ddp's own figure, in resident memory: 1.03 of its plan
    assert abs(measured["plan"]["ddp"] - rest["ddp"]) <= 0.15 * rest["ddp"], _whole(measured)


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
    2-GPU layout, tests/gpu) reads within 10% of the real 2-process run at rest, layout by layout, in
    live bytes (malloc's in use), as the other figures here: resident memory at glibc's default keeps
    freed blocks where they landed, and zero1's read 101.3 MiB alone against 113.6 beside a peer (CI,
    11% apart) while its live bytes read 120.4 against 121.1 (ddp 148.5/149.1, zero3 86.1/87.0,
    tp2 94.6/95.6)."""
    out = tmp_path / "fake.json"
    done = subprocess.run(
        [
            sys.executable,
            "bench/memory.py",
            "--fake-world",
            "--layouts",
            "ddp",
            "zero1",
            "zero3",
            "tp2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    fake = {name: runs[0]["in_use"] for name, runs in json.loads(out.read_text())["runs"].items()}
    real = _figure(measured, "in_use")
    assert all(abs(fake[name] - real[name]) <= 0.1 * real[name] for name in fake), f"fake world {fake}: " + _whole(
        measured
    )
