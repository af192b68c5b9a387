"""Port checks for the rendezvous store, done before any worker starts.

A single-node run with no port needs no check: the store binds port 0 and the kernel picks a free
one, so a busy 29500 never matters. An explicit port is checked here so a conflict is reported by
name instead of as a store time-out minutes later.
"""

from __future__ import annotations

import errno
import socket

from phalanx.launch.spec import LaunchError


def is_port_free(port: int, host: str = "") -> bool:
    """True when a TCP listener could bind `port` (on all interfaces by default, like TCPStore)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same option the store's listener uses: a port in TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_master_port(port: int) -> None:
    """Refuse an explicit --master-port that is already in use on this machine."""
    if not is_port_free(port):
        raise LaunchError(
            f"--master-port {port} is already in use on this machine. "
            "HINT: omit --master-port to let phalanx pick a free port (single node), "
            "or pick another port."
        )
