"""An elastic two-node job (`--nnodes 1:2`, c10d) loses a node, finishes on the other, and takes the
node back when it returns: the global batch stays the same throughout (split_batches).

Two network namespaces joined by a veth pair are the nodes (10.251.0.1 hosts the rendezvous,
10.251.0.2 is the node taken away; names and subnet differ from the other multinode tests so they can
run side by side). Each runs `phalanx run --nproc-per-node 2` of tests/multinode/elastic_train.py:

1. 4 ranks train to step 8 (checkpoints every 4 steps) and park there;
2. every process of node B (its launcher and both workers) is killed with SIGKILL; node A's workers
   fail at their next collective, its launcher re-rendezvouses with the one node left and restarts
   2 workers, which resume the step-8 checkpoint with 8 samples each instead of 4;
3. they park at step 24; node B's `phalanx run` is started again, node A's launcher sees it waiting,
   restarts the group with both nodes, and 4 ranks resume step 24 and finish at 48.

The final weights equal a one-process run of the same script (allclose, as any two world sizes are).
Needs root and iproute2 (scripts/ci-netns-deps); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.multinode.namespaces import two_nodes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "elastic_train.py"
ADDR = {"a": "10.251.0.1", "b": "10.251.0.2"}
PORT = 29721
STEP_LIMIT_S = 240  # each phase (reaching a park, a restart) must happen within this
pytestmark = [pytest.mark.multinode, pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def nodes():
    with two_nodes("pxe", ADDR) as names:
        yield names


def _start(ns: str, tmp: Path, log: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "SLURM_", "MASTER_"))}
    # TMPDIR in the test's folder: a node killed with SIGKILL cannot remove its launcher's private
    # temporary directory, which would otherwise stay behind in /tmp
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), TMPDIR=str(tmp))
    cmd = [
        "ip",
        "netns",
        "exec",
        ns,
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{ADDR['a']}:{PORT}",
        "--rdzv-timeout",
        "120",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        # a dead node is noticed after 3 missed 1 s heartbeats; a rendezvous that has its minimum
        # waits 10 s more for others (torch's defaults: 5 s x 3 and 30 s)
        "--rdzv-conf",
        "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=10",
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--split-batches",
        "--checkpoint-keep",
        "0",
        str(SCRIPT),
        "--out",
        str(tmp / "out"),
        "--park",
        "4:8,2:24",
    ]
    with open(tmp / log, "w") as f:
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(what: str, ready, procs: list[subprocess.Popen], tmp: Path) -> None:
    deadline = time.monotonic() + STEP_LIMIT_S
    while not ready():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            logs = "\n".join(f"--- {p.name} ---\n{p.read_text()[-6000:]}" for p in sorted(tmp.glob("node-*.log")))
            raise AssertionError(f"{what}: not within {STEP_LIMIT_S} s\n{logs}")
        time.sleep(0.2)


def _parked(out: Path, world: int, step: int) -> bool:
    return len(list(out.glob(f"parked-{world}-{step}-*"))) == world


def _kill_namespace(ns: str) -> list[int]:
    """Every process in the namespace gone at once, launcher and workers alike, as when a node dies:
    all stopped first, then killed (workers get SIGINT when their launcher dies; stopped, they
    cannot act on it before the SIGKILL)."""
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return pids


@pytest.fixture(scope="module")
def run(nodes, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("node-loss")
    (tmp / "out").mkdir()
    (tmp / "ref").mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    reference = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--out", str(tmp / "ref")],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = tmp / "out"
    started = time.monotonic()
    # B first: a joining node waits for the store, so both are there when node A opens the first round.
    b = _start(nodes["b"], tmp, "node-b.log")
    a = _start(nodes["a"], tmp, "node-a.log")
    procs = [a, b]
    try:
        _wait_for("4 ranks parked at step 8", lambda: _parked(out, 4, 8), procs, tmp)
        killed = _kill_namespace(nodes["b"])
        lost_at = time.monotonic()
        b.wait(timeout=30)
        (out / "go-4-8").write_text("")
        _wait_for("2 ranks parked at step 24 on the node left", lambda: _parked(out, 2, 24), [a], tmp)
        shrunk_s = time.monotonic() - lost_at
        b_again = _start(nodes["b"], tmp, "node-b-again.log")
        procs = [a, b_again]
        rejoined_at = time.monotonic()
        _wait_for("both nodes finished", lambda: a.poll() is not None and b_again.poll() is not None, procs, tmp)
        grown_s = time.monotonic() - rejoined_at
        reference_out, _ = reference.communicate(timeout=STEP_LIMIT_S)
    finally:
        for p in (a, b, *([b_again] if "b_again" in locals() else [])):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for ns in nodes.values():
            _kill_namespace(ns)
        if reference.poll() is None:
            reference.kill()
    print(
        f"node loss: killed {len(killed)} processes of node B; 2 ranks parked again {shrunk_s:.1f} s later; "
        f"node B back and both finished {grown_s:.1f} s later; {time.monotonic() - started:.1f} s in all"
    )
    assert reference.returncode == 0, reference_out
    return {
        "a": a.returncode,
        "b": b_again.returncode,
        "log_a": (tmp / "node-a.log").read_text(),
        "log_b": (tmp / "node-b-again.log").read_text(),
        "events": [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()],
        "final": torch.load(out / "final.pt", weights_only=True),
        "reference": torch.load(tmp / "ref" / "final.pt", weights_only=True),
    }


def test_the_job_shrinks_to_one_node_and_grows_back_keeping_the_global_batch(run):
    assert run["a"] == 0, run["log_a"][-6000:]
    assert run["b"] == 0, run["log_b"][-6000:]
    assert run["events"] == [
        {"world_size": 4, "step": 0, "resumed": False, "batch_per_rank": 4},
        {"world_size": 2, "step": 8, "resumed": True, "batch_per_rank": 8},  # node B gone: from the last checkpoint
        {"world_size": 4, "step": 24, "resumed": True, "batch_per_rank": 4},  # node B back
    ]


def test_the_weights_equal_one_process_trained_on_the_same_global_batches(run):
    assert run["final"].keys() == run["reference"].keys() and len(run["final"]) == 4
    for name, expected in run["reference"].items():
        torch.testing.assert_close(run["final"][name], expected, rtol=1e-5, atol=1e-6)


def test_each_restart_is_announced_with_the_old_and_new_world_size(run):
    log = run["log_a"]
    assert "phalanx: restart 1 of 3: rank " in log  # a worker of node A failed when node B vanished
    assert f"phalanx: restarting with 2 processes (was 4) after node {ADDR['b']} left" in log
    assert f"phalanx: restarting with 4 processes (was 2): node {ADDR['b']} joined" in log
