"""Two "nodes" for the multinode tests: network namespaces joined by a veth pair (netns.sh)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

NETNS = Path(__file__).parent / "netns.sh"


def why_no_netns() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, as CI does)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed: run scripts/ci-netns-deps (apt-get install iproute2)"
    return None


@contextlib.contextmanager
def two_nodes(prefix: str, addresses: dict[str, str]) -> Iterator[dict[str, str]]:
    """Namespaces `<prefix><pid>a` and `...b` with `addresses["a"]`/`["b"]`; skips the test with the
    reason where they cannot be made. Each test module passes its own prefix and /24 subnet, so
    modules can run side by side."""
    reason = why_no_netns()
    if reason:
        pytest.skip(reason)
    tag = f"{prefix}{os.getpid() % 100000}"
    names = {"a": tag + "a", "b": tag + "b"}
    up = subprocess.run(
        [str(NETNS), "up", names["a"], names["b"], addresses["a"], addresses["b"]], capture_output=True, text=True
    )
    if up.returncode != 0:
        subprocess.run([str(NETNS), "down", names["a"], names["b"]])
        pytest.skip(f"cannot create network namespaces here: {up.stderr.strip()}")
    try:
        yield names
    finally:
        subprocess.run([str(NETNS), "down", names["a"], names["b"]], check=True)
