"""The rendezvous store listens only on the named address (loopback on one node), not on `*`."""

import datetime
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from phalanx.launch import bound_store
from phalanx.launch.bound_store import BoundStaticRendezvous, bind_listener

from tests.cluster.listeners import listening_addresses

SCRIPT = Path(__file__).parent / "scripts" / "report_store_listeners.py"


def test_torch_store_alone_listens_everywhere():
    """The reason for bound_store: TCPStore given 127.0.0.1 still binds every interface."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    assert listening_addresses(store.port) in (["::"], ["0.0.0.0"], ["0.0.0.0", "::"])


def test_bound_store_listens_on_loopback_only_and_serves_clients():
    handler = BoundStaticRendezvous("127.0.0.1", 0, rank=0, world_size=1, run_id="t", timeout_s=10)
    info = handler.next_rendezvous()
    port = info.bootstrap_store_info.master_port
    assert port > 0 and info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert listening_addresses(port) == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("t/key", "value")  # the handler's store is prefixed with the run id
    assert info.store.get("key") == b"value"
    assert handler.next_rendezvous().bootstrap_store_info.master_port == port  # restarts reuse the store


def test_hosting_c10d_store_listens_on_the_nodes_own_address_only(monkeypatch):
    """Multi-node c10d (torch's store would bind every interface): the host binds its local_addr."""
    params = RendezvousParameters(
        backend="phalanx-c10d",
        endpoint="127.0.0.1:0",
        run_id="c",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        is_host=True,
        join_timeout=20,
    )
    ports = []

    def recording(host, port):
        listener = bind_listener(host, port)
        ports.append(listener.getsockname()[1])
        return listener

    monkeypatch.setattr(bound_store, "bind_listener", recording)
    bound_store.register()
    handler = rendezvous_handler_registry.create_handler(params)  # as torch's agent gets it
    info = handler.next_rendezvous()
    rendezvous_port, workers_port = ports
    assert workers_port == info.bootstrap_store_info.master_port  # the store torch opens for the workers
    assert listening_addresses(rendezvous_port) == ["127.0.0.1"]
    assert listening_addresses(workers_port) == ["127.0.0.1"]
    assert (info.rank, info.world_size, info.bootstrap_store_info.master_addr) == (0, 1, "127.0.0.1")
    handler.shutdown()


def test_busy_port_is_named():
    with bind_listener("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        # SO_REUSEADDR does not allow two listeners on one port
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}.*HINT: pick another --master-port"):
            bind_listener("127.0.0.1", port)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "flags",
    [[], ["--master-port", "0"], ["--standalone"], ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]],
    ids=["free-port", "explicit", "standalone", "c10d"],
)
def test_single_node_phalanx_run_store_is_loopback_only(flags, tmp_path):
    """Listening on 127.0.0.1 only, and refused on the machine's other addresses (torchrun's
    standalone and c10d stores would accept connections there)."""
    if flags == ["--master-port", "0"]:
        with bind_listener("127.0.0.1", 0) as probe:
            flags = ["--master-port", str(probe.getsockname()[1])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", *flags, str(SCRIPT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("LISTENERS")]
    _, addr, port, listeners = line.split()
    assert (addr, listeners) == ("127.0.0.1", "127.0.0.1")
    assert "REACHABLE_ELSEWHERE none" in proc.stdout.splitlines()
    if flags[:1] == ["--master-port"]:
        assert port == flags[1]


def _run_under_etcd(tmp_path, backend: str, *script_args: str) -> str:
    """The listeners script under `phalanx run --rdzv-backend BACKEND` with a real etcd on loopback: its
    LISTENERS line, once nothing else was reachable."""
    from tests.multinode.etcd_server import etcd_server

    with bind_listener("127.0.0.1", 0) as a, bind_listener("127.0.0.1", 0) as b:
        ports = a.getsockname()[1], b.getsockname()[1]
    with etcd_server(tmp_path, "127.0.0.1", *ports) as endpoint:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "phalanx",
                "run",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                backend,
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                f"bound-{backend}-{os.getpid()}",
                str(SCRIPT),
                *script_args,
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REACHABLE_ELSEWHERE none" in proc.stdout.splitlines()
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("LISTENERS")]
    return line


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_etcd_v2_workers_store_listens_on_the_node_s_address_only(tmp_path):
    """`--rdzv-backend etcd-v2` (etcd on loopback): the workers' store torch opens on rank 0's node
    listened on `*:PORT`, open to every interface; it binds the node's address as static and c10d do."""
    line = _run_under_etcd(tmp_path, "etcd-v2")
    _, addr, port, listeners = line.split()
    assert (addr, listeners) == ("127.0.0.1", "127.0.0.1"), line


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_etcd_workers_store_listens_on_the_master_address_only(tmp_path):
    """torch's older `--rdzv-backend etcd`: the workers open the process group's store themselves,
    and rank 0's listened on every interface (`::`); under phalanx run it binds MASTER_ADDR."""
    line = _run_under_etcd(tmp_path, "etcd", "--init")
    _, addr, port, listeners = line.split()
    assert listeners.split(",") == [socket.gethostbyname(addr)], line
