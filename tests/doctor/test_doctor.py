"""`phalanx doctor`: a clean report on this machine, and each staged problem named with its fix."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from phalanx.doctor import allreduce as allreduce_module
from phalanx.doctor import checks
from phalanx.doctor.allreduce import run_allreduce
from phalanx.doctor.findings import FAIL, OK, WARN, exit_code

CLI_TIMEOUT_S = 120


def _doctor(args, env_changes=None):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    }
    env.update(env_changes or {})
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    return proc


@pytest.fixture(scope="module")
def clean():
    proc = _doctor(["--json"])
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def broken():
    """Three problems at once: a busy port, a bogus CUDA_VISIBLE_DEVICES, an unresolvable master."""
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _doctor(
            ["--port", str(port), "--master-addr", "no-such-master.invalid", "--no-allreduce"],
            {"CUDA_VISIBLE_DEVICES": "0,banana"},
        )
    return port, proc


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_clean_report_on_this_machine(clean):
    code, report = clean
    assert code == 0 and report["ok"] is True
    statuses = {c["check"]: c["status"] for c in report["checks"]}
    assert [name for name, status in statuses.items() if status == FAIL] == []
    assert {"versions", "gpus", "port 29500", "hostname", "master", "shm", "open files", "slurm"} <= set(statuses)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_clean_report_measures_a_live_allreduce(clean):
    _, report = clean
    (allreduce,) = [c for c in report["checks"] if c["check"].startswith("all-reduce")]
    assert allreduce["status"] == OK and allreduce["data"]["correct"] is True
    assert allreduce["data"]["nproc"] == 2 and allreduce["data"]["size_mb"] == 16
    assert allreduce["data"]["algbw_gbps"] > 0 and allreduce["data"]["busbw_gbps"] == pytest.approx(
        allreduce["data"]["algbw_gbps"]
    )
    print(f"doctor all-reduce: {allreduce['detail']}")


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_each_problem_is_named_with_its_fix_and_fails_the_exit_code(broken):
    port, proc = broken
    out = proc.stdout
    assert proc.returncode == 1
    assert " FAIL  gpus: CUDA_VISIBLE_DEVICES='0,banana' has invalid entries ['banana']" in out
    assert f" FAIL  port {port}: in use on this machine (the port the launch will use)" in out
    assert f"fix: find the owner with `ss -ltnp 'sport = :{port}'`" in out
    assert " FAIL  master: cannot resolve 'no-such-master.invalid'" in out
    assert "fix: use the master's IP address, or add no-such-master.invalid to /etc/hosts" in out
    assert "phalanx doctor: 3 problem(s) would break a launch" in out


@pytest.mark.parametrize(
    "env, visible, physical, status, fragment",
    [
        ({}, 0, 0, OK, "0 GPU(s) visible (CPU-only"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2, 4, OK, "2 GPU(s) visible"),
        ({"CUDA_VISIBLE_DEVICES": "0,banana"}, 1, 4, FAIL, "invalid entries ['banana']"),
        ({"CUDA_VISIBLE_DEVICES": "1,1"}, 1, 4, FAIL, "lists a GPU twice"),
        ({"CUDA_VISIBLE_DEVICES": "3,7"}, 1, 4, FAIL, "lists 2 GPU(s) but CUDA sees 1 of this machine's 4 (no GPU 7)"),
        ({"CUDA_VISIBLE_DEVICES": "99"}, 0, 0, WARN, "this machine has no NVIDIA GPU"),
    ],
)
def test_gpu_check(env, visible, physical, status, fragment):
    (finding,) = checks.check_gpus(env, visible, physical)
    assert finding.status == status and fragment in finding.detail
    if status != OK:
        assert "CUDA_VISIBLE_DEVICES" in finding.fix


def test_busy_default_port_only_warns_busy_required_port_fails():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert [f.status for f in checks.check_ports([port], set())] == [WARN]
        assert [f.status for f in checks.check_ports([port], {port})] == [FAIL]


def test_slurm_check_reports_an_inconsistent_allocation():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    (finding,) = checks.check_slurm(env)
    assert finding.status == FAIL and "lists 3 host(s)" in finding.detail
    assert "do not override SLURM_* variables" in finding.fix


def test_master_check_names_the_interface():
    (finding,) = checks.check_master("127.0.0.1", {})
    assert finding.status == OK and finding.data["ifname"] == "lo" and finding.data["is_local"] is True


def _never_finishing_worker(*args) -> None:
    time.sleep(120)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_hung_allreduce_is_cut_at_the_timeout(monkeypatch):
    # A real hang (the worker never returns), not a race against a short timeout.
    monkeypatch.setattr(allreduce_module, "_worker", _never_finishing_worker)
    start = time.monotonic()
    finding = run_allreduce(2, 1, timeout_s=1.0)
    assert finding.status == FAIL and "did not finish within 1 s (ranks [0, 1] still running)" in finding.detail
    assert time.monotonic() - start < 30
    assert exit_code([finding]) == 1
