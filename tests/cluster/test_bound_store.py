"""The rendezvous store listens only on the named address (loopback on one node), not on `*`."""
import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.cluster.bound_store import BoundStaticRendezvous, bind_listener

from tests.cluster.listeners import listening_addresses

SCRIPT = Path(__file__).parent / "scripts" / "report_store_listeners.py"


def test_torch_store_alone_listens_everywhere():
    """The reason for bound_store: TCPStore given 127.0.0.1 still binds every interface."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
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


def test_busy_port_is_named():
    with bind_listener("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        # SO_REUSEADDR does not allow two listeners on one port
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}.*HINT: pick another --master-port"):
            bind_listener("127.0.0.1", port)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [[], ["--master-port", "0"]], ids=["free-port", "explicit"])
def test_single_node_phalanx_run_store_is_loopback_only(flags, tmp_path):
    if flags:
        with bind_listener("127.0.0.1", 0) as probe:
            flags = ["--master-port", str(probe.getsockname()[1])]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", *flags, str(SCRIPT)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("LISTENERS")]
    _, addr, port, listeners = line.split()
    assert (addr, listeners) == ("127.0.0.1", "127.0.0.1")
    if flags:
        assert port == flags[1]
