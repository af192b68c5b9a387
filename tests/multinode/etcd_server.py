"""An etcd server (Debian's etcd-server, v2 API on) for the etcd rendezvous tests: a temporary data
directory, the given client and peer addresses, stopped and removed afterwards.

`etcd` comes from scripts/ci-etcd-deps; the tests skip with that hint where it is missing."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterator

import pytest

from tests.server_process import stop


def why_no_etcd() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd is not installed: run scripts/ci-etcd-deps (apt-get install etcd-server)"
    try:
        import etcd  # noqa: F401  (python-etcd: torch's etcd rendezvous client)
    except ImportError:
        return "python-etcd is not installed: pip install -e '.[etcd]'"
    return None


@contextlib.contextmanager
def etcd_server(data_dir: Path, host: str, client_port: int, peer_port: int, netns: str | None = None) -> Iterator[str]:
    """Run etcd (inside network namespace `netns` if given); yield its client endpoint HOST:PORT."""
    reason = why_no_etcd()
    if reason:
        pytest.skip(reason)
    log = open(data_dir / "etcd.log", "ab")
    proc = start_etcd(data_dir, host, client_port, peer_port, log, netns)
    try:
        yield f"{host}:{client_port}"
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(data_dir / "etcd", ignore_errors=True)


def start_etcd(
    data_dir: Path, host: str, client_port: int, peer_port: int, log: IO[bytes], netns: str | None = None
) -> subprocess.Popen:
    """etcd on host:client_port with its data in DATA_DIR/etcd (kept: a restart finds its keys), once it answers."""
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    command = [
        "etcd",
        "--enable-v2",
        "--name",
        "phalanx-test",
        "--data-dir",
        str(data_dir / "etcd"),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"phalanx-test={peer}",
    ]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not _answers(host, client_port, netns):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise AssertionError((data_dir / "etcd.log").read_text()[-3000:])
        time.sleep(0.3)
    return proc


def _answers(host: str, port: int, netns: str | None) -> bool:
    if netns is None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return True
        return False
    probe = [
        "ip",
        "netns",
        "exec",
        netns,
        sys.executable,
        "-c",
        f"import socket; socket.create_connection(({host!r}, {port}), timeout=1)",
    ]
    return subprocess.run(probe, capture_output=True).returncode == 0
