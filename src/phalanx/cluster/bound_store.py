"""A static rendezvous whose store listens on the address the user named, and nowhere else.

Why: torch's TCPStore server binds every interface (`*:port`) whatever host it is given, so a
single-node job's store on "127.0.0.1" is reachable from the whole network, and a multi-node
job's store listens on interfaces the user never named. Here the launcher binds the listening
socket itself (loopback on one node, `--master-addr` across nodes) and hands it to TCPStore
through `master_listen_fd`. Otherwise this behaves as torch's static rendezvous: node 0 hosts the
store and waits for the others, every node knows its rank. Imported lazily (it imports torch).
"""
from __future__ import annotations

import datetime
import socket

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from phalanx.cluster.rendezvous import BOUND_STATIC_BACKEND, DEFAULT_RDZV_TIMEOUT_S, split_endpoint


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly host:port (port 0: the kernel picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own listener does
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port} for the rendezvous store: {error.strerror}. HINT: pick another "
            "--master-port, or check that --master-addr is an address of this node."
        ) from None
    sock.listen(4096)
    return sock


class BoundStaticRendezvous(RendezvousHandler):
    """Static rendezvous (fixed rank and node count) with a store bound to one address."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, run_id: str, timeout_s: float):
        self._host, self._port, self._rank, self._world_size = host, port, rank, world_size
        self._run_id = run_id
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: TCPStore | None = None
        self._listener: socket.socket | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BOUND_STATIC_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store (MASTER_ADDR/MASTER_PORT below) as clients

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            if self._rank == 0:
                self._listener = bind_listener(self._host, self._port)
                self._port = self._listener.getsockname()[1]
                self._store = TCPStore(self._host, self._port, self._world_size, True, self._timeout,
                                       multi_tenant=True, master_listen_fd=self._listener.fileno())
            else:
                self._store = TCPStore(self._host, self._port, self._world_size, False, self._timeout,
                                       multi_tenant=True)
        store = PrefixStore(self._run_id, self._store)
        return RendezvousInfo(store, self._rank, self._world_size, RendezvousStoreInfo(self._host, self._port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = split_endpoint(params.endpoint)
    return BoundStaticRendezvous(
        host=host,
        port=port or 0,
        rank=int(params.config.get("rank", 0)),
        world_size=params.max_nodes,
        run_id=params.run_id,
        timeout_s=float(params.config.get("timeout", DEFAULT_RDZV_TIMEOUT_S)),
    )


def register() -> None:
    """Make `BOUND_STATIC_BACKEND` known to torch's elastic agent (idempotent)."""
    rendezvous_handler_registry.register(BOUND_STATIC_BACKEND, create_handler)
