"""A real two-node run on one machine: two network namespaces joined by a veth pair.

Each namespace is a "node" with its own address (10.250.0.1 / 10.250.0.2, a private test range)
and its own loopback; the only link between them is the veth pair, so traffic never leaves those
two namespaces. One `phalanx run --nnodes 2 --nproc-per-node 1` runs in each and trains the wine
example over TCP through torch's real rendezvous (static and c10d). Needs root and iproute2
(scripts/ci-netns-deps installs it in CI); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.multinode.namespaces import two_nodes

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "wine.py"
ADDR = {"a": "10.250.0.1", "b": "10.250.0.2"}
RDZV_TIMEOUT_S = 15
RUN_TIMEOUT_S = 180
pytestmark = [pytest.mark.multinode, pytest.mark.dist, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nodes():
    with two_nodes("px", ADDR) as names:
        yield names


def _phalanx(ns: str, flags: list[str], tmp: Path) -> dict:
    """One `phalanx run` inside namespace `ns`; returns its exit code, output and duration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "SLURM_", "MASTER_"))}
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
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-timeout",
        str(RDZV_TIMEOUT_S),
        *flags,
        str(WINE),
        "--epochs",
        "3",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr, "seconds": time.monotonic() - start}


def _pair(names, flags_a, flags_b, tmp):
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_phalanx, names["a"], flags_a, tmp)
        b = pool.submit(_phalanx, names["b"], flags_b, tmp)
        return a.result(), b.result()


@pytest.fixture(scope="module")
def runs(nodes, tmp_path_factory):
    """All launches, grouped: two pairs one after the other, then both lone-node cases at once."""
    tmp = tmp_path_factory.mktemp("netns")
    static = ["--master-addr", ADDR["a"], "--master-port", "29611"]
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR['a']}:29612"]
    results = {
        "static": _pair(nodes, [*static, "--node-rank", "0"], [*static, "--node-rank", "1"], tmp),
        "c10d": _pair(nodes, c10d, c10d, tmp),
    }
    # The second node never comes: node 0 alone (static) in one namespace while, in the other, a
    # node waits for a c10d store nobody starts (10.250.0.1:29614 has no listener). Meanwhile (those
    # two mostly wait) an elastic pair, --nnodes 1:2, on its own port.
    elastic = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR['a']}:29615", "--nnodes", "1:2"]
    with ThreadPoolExecutor(1) as pool:
        elastic_pair = pool.submit(_pair, nodes, elastic, elastic, tmp)
        results["static_alone"], results["c10d_no_store"] = _pair(
            nodes,
            ["--master-addr", ADDR["a"], "--master-port", "29613", "--node-rank", "0"],
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR['a']}:29614"],
            tmp,
        )
        results["elastic"] = elastic_pair.result()
    for name, runs_ in results.items():  # figures for the record (pytest -s)
        runs_ = runs_ if isinstance(runs_, tuple) else (runs_,)
        print(f"netns {name}: " + ", ".join(f"rc={r['rc']} {r['seconds']:.1f}s" for r in runs_))
    return results


def _losses(text: str) -> list[str]:
    return re.findall(r"epoch \d+: loss [\d.]+", text)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_nodes_train_wine(runs, backend):
    node0, node1 = runs[backend]
    assert node0["rc"] == 0, node0["err"]
    assert node1["rc"] == 0, node1["err"]
    assert "(2 process(es), strategy ddp)" in node0["out"]
    assert len(_losses(node0["out"])) == 2  # epochs 0 and 2 of 3, printed by rank 0 only
    assert node1["out"].strip() == ""  # rank 1 prints nothing: px.print is rank 0's


def test_elastic_range_passes_through_and_both_nodes_train(runs):
    node0, node1 = runs["elastic"]
    assert node0["rc"] == 0 and node1["rc"] == 0, node0["err"] + node1["err"]
    both = node0["out"] + node1["out"]  # which node gets rank 0 is the rendezvous's choice
    assert "(2 process(es), strategy ddp)" in both
    assert _losses(both) == _losses(runs["static"][0]["out"])


def test_static_and_c10d_train_identically(runs):
    assert _losses(runs["static"][0]["out"]) == _losses(runs["c10d"][0]["out"])


@pytest.mark.parametrize(
    "backend, node, ifname, addr, role",
    [
        ("static", 0, "av", "10.250.0.1", "hosts the store"),
        ("static", 1, "bv", "10.250.0.2", "joins the store"),
        ("c10d", 0, "av", "10.250.0.1", "hosts the store"),
        ("c10d", 1, "bv", "10.250.0.2", "joins the store"),
    ],
)
def test_interface_and_store_role_are_worked_out_and_said(runs, nodes, backend, node, ifname, addr, role):
    iface = nodes["a"][:-1] + ifname
    err = runs[backend][node]["err"]
    assert f"phalanx: this node ({addr} on {iface}) {role} at 10.250.0.1:" in err
    assert f"GLOO_SOCKET_IFNAME={iface}, NCCL_SOCKET_IFNAME={iface}" in err


def test_second_node_never_comes_static(runs):
    alone = runs["static_alone"]
    assert alone["rc"] == 1
    assert f"the rendezvous did not complete within {RDZV_TIMEOUT_S} s (static, 2 node(s) expected)" in alone["err"]
    assert "missing: the other node(s). This node (node 0, 10.250.0.1 on" in alone["err"]
    assert "hosts the store at 10.250.0.1:29613" in alone["err"]
    # Never an endless wait: the launch ended by itself through the rendezvous timeout (the report
    # above); a hang would have hit RUN_TIMEOUT_S. No wall-clock bound here: start-up under load varies.


def test_master_never_comes_c10d(runs):
    lone = runs["c10d_no_store"]
    assert lone["rc"] == 1
    assert f"the rendezvous did not complete within {RDZV_TIMEOUT_S} s (c10d, 2 node(s) expected)" in lone["err"]
    assert "missing: the store at 10.250.0.1:29614. This node tried 10.250.0.1 from 10.250.0.2 on" in lone["err"]
