"""Rendezvous stores that listen on the address the user named, and nowhere else (static, c10d,
etcd-v2: the store etcd-v2's rank 0 opens for the workers).

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
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from phalanx.launch import etcd_store
from phalanx.launch.rendezvous import (
    BOUND_C10D_BACKEND,
    BOUND_ETCD_BACKEND,
    BOUND_ETCD_V2_BACKEND,
    BOUND_STATIC_BACKEND,
    DEFAULT_RDZV_TIMEOUT_S,
    split_endpoint,
)

C10D_DEFAULT_PORT = 29400  # torchrun's default port for a c10d endpoint without one


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


def store_on(listener: socket.socket, host: str, **kwargs: Any) -> TCPStore:
    """A master TCPStore serving on `listener`, which it takes over: the store closes the socket when
    it goes, so the Python object lets go of it now (else it would close the fd a second time, or
    warn "unclosed socket" when collected)."""
    store = TCPStore(
        host, listener.getsockname()[1], is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(), **kwargs
    )
    listener.detach()
    return store


class BoundStaticRendezvous(RendezvousHandler):
    """Static rendezvous (fixed rank and node count) with a store bound to one address."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, run_id: str, timeout_s: float):
        self._host, self._port, self._rank, self._world_size = host, port, rank, world_size
        self._run_id = run_id
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BOUND_STATIC_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store (MASTER_ADDR/MASTER_PORT below) as clients

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            if self._rank == 0:
                listener = bind_listener(self._host, self._port)
                self._port = listener.getsockname()[1]
                self._store = store_on(listener, self._host, world_size=self._world_size, timeout=self._timeout)
            else:
                self._store = TCPStore(
                    self._host, self._port, self._world_size, False, self._timeout, multi_tenant=True
                )
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


def create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous, with its two stores bound to one address each instead of every interface.

    - the rendezvous store, on the hosting node (`is_host`): bound to `params.local_addr` (the
      address the other nodes reach it on), else the endpoint's host;
    - the workers' store that torch opens on whichever node becomes rank 0: bound to that node's
      address (`_create_tcp_store_server`, replaced on the handler).
    File stores and joining nodes open no rendezvous listener, so their handler is torch's own.
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if params.get("store_type", "tcp").strip().lower() != "tcp" or not params.get_as_bool("is_host", False):
        return _bind_workers_store(_create_c10d_handler(params))
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=C10D_DEFAULT_PORT)
    read_timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store = _bound_tcp_store(params.local_addr or host, port, read_timeout)
    return _bind_workers_store(dynamic_handler(store, C10dRendezvousBackend(store, params.run_id), params))


def create_etcd_v2_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's etcd-v2 rendezvous (etcd holds the rendezvous), with the workers' store that rank 0's
    node opens bound to that node's address (`local_addr`: loopback on one node), where torch's
    would listen on every interface without authentication. It outlives an etcd outage of up to
    --rdzv-timeout while the workers run (etcd_store.py)."""
    from torch.distributed.elastic.rendezvous.registry import _create_etcd_v2_handler

    handler = _bind_workers_store(_create_etcd_v2_handler(params), BOUND_ETCD_V2_BACKEND)
    return _outliving_outages(handler, params)


def create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's older etcd rendezvous, outliving an etcd outage as etcd-v2 does (etcd_store.py)."""
    from torch.distributed.elastic.rendezvous.registry import _create_etcd_handler

    handler = _create_etcd_handler(params)
    handler.get_backend = lambda: BOUND_ETCD_BACKEND  # type: ignore[method-assign]  # the registry checks it
    return _outliving_outages(handler, params)


def _outliving_outages(handler: RendezvousHandler, params: RendezvousParameters) -> RendezvousHandler:
    wait_s = float(params.config.get(etcd_store.OUTAGE_CONFIG_KEY, DEFAULT_RDZV_TIMEOUT_S))
    return etcd_store.tolerate_outage(handler, params.endpoint, wait_s)


def _bound_tcp_store(host: str, port: int, timeout: datetime.timedelta | None = None) -> TCPStore:
    extra = {"timeout": timeout} if timeout is not None else {}
    return store_on(bind_listener(host, port), host, **extra)


def _bind_workers_store(handler: RendezvousHandler, backend: str = BOUND_C10D_BACKEND) -> RendezvousHandler:
    handler._backend_name = backend  # type: ignore[attr-defined]  # torch's registry checks the name
    if hasattr(handler, "_create_tcp_store_server"):  # absent in a torch without the shared workers' store
        handler._create_tcp_store_server = lambda addr, port: _bound_tcp_store(addr, port)  # type: ignore[attr-defined]
    if hasattr(handler, "_bootstrap_store_info"):
        handler.next_rendezvous = _with_fresh_workers_store(handler)  # type: ignore[method-assign]
    return handler


def _with_fresh_workers_store(handler: RendezvousHandler):  # type: ignore[no-untyped-def]
    """`handler.next_rendezvous`, publishing the workers' store address in every round, not only the first.

    torch's c10d handler publishes where the workers' store is (MASTER_ADDR/PORT, in the round's
    keys) only in a node's first round, and reuses what it found then in later ones. A node that
    joins a running elastic job (a lost node coming back) then waits for an address its rank-0 peer
    never writes again, until the store timeout; a node whose rank-0 peer was replaced would send
    its workers to the old one's store. Forgetting the cached address before each round makes rank 0
    open a workers' store for the round and publish it, and every other node read it: each attempt
    gets a store of its own, as in its first round.
    """
    next_rendezvous = handler.next_rendezvous

    def fresh() -> RendezvousInfo:
        handler._bootstrap_store_info = None  # type: ignore[attr-defined]
        return next_rendezvous()

    return fresh


def register() -> None:
    """Make the BOUND_* backends known to torch's elastic agent (idempotent)."""
    rendezvous_handler_registry.register(BOUND_STATIC_BACKEND, create_handler)
    rendezvous_handler_registry.register(BOUND_C10D_BACKEND, create_c10d_handler)
    rendezvous_handler_registry.register(BOUND_ETCD_V2_BACKEND, create_etcd_v2_handler)
    rendezvous_handler_registry.register(BOUND_ETCD_BACKEND, create_etcd_handler)
