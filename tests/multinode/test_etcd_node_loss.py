"""With torch's etcd rendezvous (`--rdzv-backend etcd-v2`), losing the FIRST node, launcher and
workers, leaves a job the other node finishes from the last checkpoint; under the default c10d
backend the first node's launcher hosts the store, and its loss ends the job everywhere.

Two network namespaces joined by a veth pair are the nodes (10.253.0.1 = node A, started first;
10.252.0.2 = node B), and etcd runs beside node B (in its namespace: the store outlives node A as a
separate etcd host would). Each node runs `phalanx run --nnodes 1:2 --nproc-per-node 2` of
tests/multinode/elastic_train.py: 4 ranks train to step 8 and park there; every process of node A
is killed with SIGKILL; node B's launcher re-rendezvouses through etcd alone, restarts 2 workers,
which resume the step-8 checkpoint and finish. The final weights equal a one-process run.
Needs root, iproute2 (scripts/ci-netns-deps) and etcd (scripts/ci-etcd-deps); skipped otherwise.
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

from tests.multinode.etcd_server import etcd_server
from tests.multinode.namespaces import two_nodes
from tests.multinode.test_node_loss import STEP_LIMIT_S, _kill_namespace, _parked, _wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "elastic_train.py"
ADDR = {"a": "10.253.0.1", "b": "10.253.0.2"}
ETCD_PORTS = (23791, 23792)
pytestmark = [pytest.mark.multinode, pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(900)]


def _start(ns: str, tmp: Path, log: str, endpoint: str) -> subprocess.Popen:
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
        "etcd-v2",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        f"etcd-node-loss-{os.getpid()}",
        "--rdzv-timeout",
        "120",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
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
        "4:8",
    ]
    with open(tmp / log, "w") as f:
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("etcd-node-loss")
    (tmp / "out").mkdir()
    (tmp / "ref").mkdir()
    with two_nodes("pxd", ADDR) as nodes, etcd_server(tmp, ADDR["b"], *ETCD_PORTS, netns=nodes["b"]) as endpoint:
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
        a = _start(nodes["a"], tmp, "node-a.log", endpoint)  # the first node
        time.sleep(2)
        b = _start(nodes["b"], tmp, "node-b.log", endpoint)
        try:
            _wait_for("4 ranks parked at step 8", lambda: _parked(out, 4, 8), [a, b], tmp)
            killed = _kill_namespace(nodes["a"])  # launcher and workers of node A; etcd lives beside node B
            a.wait(timeout=30)
            (out / "go-4-8").write_text("")
            _wait_for("node B finished", lambda: b.poll() is not None, [b], tmp)
            reference_out, _ = reference.communicate(timeout=STEP_LIMIT_S)
        finally:
            for p in (a, b):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            _kill_namespace(nodes["a"])
            if reference.poll() is None:
                reference.kill()
    assert killed and reference.returncode == 0, reference_out
    return {
        "b": b.returncode,
        "log_a": (tmp / "node-a.log").read_text(),
        "log_b": (tmp / "node-b.log").read_text(),
        "events": [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()],
        "final": torch.load(out / "final.pt", weights_only=True),
        "reference": torch.load(tmp / "ref" / "final.pt", weights_only=True),
    }


def test_the_other_node_finishes_from_the_last_checkpoint_after_the_first_node_is_lost(run):
    assert run["b"] == 0, run["log_b"][-6000:]
    assert [(e["world_size"], e["step"], e["resumed"]) for e in run["events"]] == [(4, 0, False), (2, 8, True)]
    assert f"phalanx: restarting with 2 processes (was 4) after node {ADDR['a']} left" in run["log_b"], run["log_b"][
        -6000:
    ]


def test_the_weights_equal_one_process_trained_on_the_same_global_batches(run):
    assert run["final"].keys() == run["reference"].keys() and len(run["final"]) == 4
    for name, expected in run["reference"].items():
        torch.testing.assert_close(run["final"][name], expected, rtol=1e-5, atol=1e-6)
