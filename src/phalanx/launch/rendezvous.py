"""Multi-node rendezvous settings worked out from the network, and clear failure reports.

The launcher calls `setup_node` for a multi-node run: it picks the interface that reaches the master
(exported as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME unless the user set them), this node's own
address (torchrun's `--local-addr`), and whether this node hosts the c10d store (torchrun's
`--rdzv-conf is_host=1/0`), so users never pass those by hand.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Mapping

from phalanx import envvars
from phalanx.config import kinds
from phalanx.cluster.network import (
    NetworkError,
    Route,
    interface_addresses,
    is_loopback,
    non_loopback_interfaces,
    route_to,
)

BOUND_STATIC_BACKEND = "phalanx-static"
"""torch's static rendezvous, but the store listens only on the named address (launch.bound_store)."""
BOUND_C10D_BACKEND = "phalanx-c10d"
"""torch's c10d rendezvous, but the hosting node's store listens only on its own address (launch.bound_store)."""
BOUND_ETCD_V2_BACKEND = "phalanx-etcd-v2"
"""torch's etcd-v2 rendezvous, but rank 0's workers' store listens only on its node's address."""
BOUND_ETCD_BACKEND = "phalanx-etcd"
"""torch's older etcd rendezvous, outliving an etcd outage mid-job (launch.etcd_store)."""
DEFAULT_RDZV_TIMEOUT_S = 600
"""torch's own c10d join timeout; `phalanx run --rdzv-timeout` lowers it."""
MAX_READ_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class NodeSetup:
    """What this node adds to a multi-node launch."""

    host: str
    """The store's host as the user named it (master address or rendezvous endpoint host)."""
    port: int
    route: Route
    ifname: str
    """The interface gloo/NCCL use on this node."""
    local_addr: str
    """This node's address as the other nodes will reach it."""
    is_host: bool
    """This node owns the store's address, so its agent hosts the store."""
    env: dict[str, str]
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, for those the user did not set."""

    def describe(self) -> str:
        role = "hosts the store" if self.is_host else "joins the store"
        exported = ", ".join(f"{k}={v}" for k, v in sorted(self.env.items())) or "socket interfaces set by the user"
        return (
            f"phalanx: this node ({self.local_addr} on {self.ifname}) {role} at {self.host}:{self.port} "
            f"({self.route.address}); {exported}"
        )


def parse_nnodes(value: str) -> tuple[int, int]:
    """`--nnodes`: "2" -> (2, 2); "1:4" -> (1, 4) (an elastic range, like torchrun)."""
    try:
        return kinds.nnodes_range(value)
    except ValueError:
        raise ValueError(
            f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}. "
            "HINT: --nnodes 2, or --nnodes 1:4 for an elastic job (needs --rdzv-backend c10d)."
        ) from None


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """ "host:port" / "[v6]:port" / "host" -> (host, port or None)."""
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if endpoint.count(":") == 1:
        host, port = endpoint.split(":")
        return host, int(port)
    return endpoint, None


def setup_node(
    host: str, port: int, env: Mapping[str, str], table: dict[str, tuple[str, ...]] | None = None
) -> NodeSetup:
    """Interface, own address and store ownership for a node reaching the store at host:port."""
    _refuse_loopback_literal(host)
    table = interface_addresses() if table is None else table
    route = route_to(host, table)
    ifname, local_addr = route.ifname, route.local_addr
    user_ifname = env.get(envvars.GLOO_SOCKET_IFNAME)
    if user_ifname:
        ifname = user_ifname.split(",")[0]
        own = [a for a in table.get(ifname, ()) if ":" not in a]
        if not own:
            raise NetworkError(
                f"{envvars.GLOO_SOCKET_IFNAME}={user_ifname!r} names no interface with an IPv4 address "
                f"that is up (up here: {_list_interfaces(table)}). HINT: unset it to let phalanx choose."
            )
        local_addr = local_addr if route.ifname == ifname else own[0]
    elif is_loopback(local_addr):
        # The store's host resolves to loopback here: this is node 0 and its hostname maps to 127.x.
        # The other nodes reach it through a real interface; use the only one there is.
        ifname, local_addr = _only_external_interface(host, table)
    exported = {name: ifname for name in (envvars.GLOO_SOCKET_IFNAME, envvars.NCCL_SOCKET_IFNAME) if not env.get(name)}
    return NodeSetup(host, port, route, ifname, local_addr, route.is_local, exported)


def rendezvous_configs(backend: str, timeout_s: float, setup: NodeSetup | None) -> dict[str, object]:
    """torch rdzv_configs for the timeout (static: `timeout`; c10d: `join_timeout`) and is_host."""
    seconds = int(max(1, round(timeout_s)))
    if backend == "static":
        return {"timeout": seconds}
    # read_timeout bounds each store connection attempt; torch retries once after a random delay,
    # so half the budget keeps an unreachable store's report within about `timeout_s`.
    read_timeout = max(1, min(seconds // 2, MAX_READ_TIMEOUT_S))
    configs: dict[str, object] = {"join_timeout": seconds, "read_timeout": read_timeout}
    if backend == "c10d" and setup is not None:
        configs["is_host"] = setup.is_host
    return configs


def describe_rendezvous_failure(
    error: BaseException,
    *,
    backend: str,
    host: str,
    port: int | None,
    nnodes: tuple[int, int],
    node_rank: int | None,
    timeout_s: float,
    setup: NodeSetup | None,
) -> str:
    """One report for a rendezvous that did not complete: what is missing, which addresses were tried."""
    low, high = nnodes
    wanted = f"{low}" if low == high else f"{low} to {high}"
    where = f"{host}:{port}" if port is not None else host
    tried = ", ".join(setup.route.addresses) if setup else host
    me = f"node {node_rank}" if node_rank is not None else "this node"
    about_me = f"{me}, " if node_rank is not None else ""
    lines = [f"phalanx: the rendezvous did not complete within {timeout_s:g} s ({backend}, {wanted} node(s) expected)."]
    if setup is not None and setup.is_host:
        lines.append(
            f"  missing: the other node(s). This node ({about_me}{setup.local_addr} on {setup.ifname}) hosts the "
            f"store at {where}, but fewer than {low} node(s) joined."
        )
        lines.append(
            "  HINT: start `phalanx run` on every other node with the same --nnodes and "
            + ("--master-addr/--master-port" if backend == "static" else "--rdzv-endpoint")
            + f", and check they can reach {setup.route.address}:{port} (firewall, `ip route get {setup.route.address}`)."
        )
    elif "wait timeout" in str(error):  # connected: the store answered, the peers did not come
        lines.append(
            f"  missing: the other node(s). {me.capitalize()} reached the store at {where} "
            f"({setup.route.address if setup else host}), but not all {low} node(s) arrived."
        )
        lines.append(
            "  HINT: start `phalanx run` on every node with the same --nnodes, store address and "
            "--rdzv-id (if you pass one)."
        )
    else:
        via = f" from {setup.local_addr} on {setup.ifname}" if setup else ""
        lines.append(
            f"  missing: the store at {where}. {me.capitalize()} tried {tried}{via}; either the host node has "
            "not started, or the address/port is wrong, or a firewall drops the connection."
        )
        lines.append(
            f"  HINT: start node 0 (the owner of {host}) first or together, check the address with "
            f"`getent hosts {host}` and the port with `nc -z {host} {port}`."
        )
    lines.append(f"  torch said: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    lines.append("  HINT: raise the limit with `phalanx run --rdzv-timeout SECONDS` if nodes start slowly.")
    return "\n".join(lines)


def _refuse_loopback_literal(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        raise NetworkError(
            f"the store address {host!r} is a loopback address: other nodes cannot reach it. "
            "HINT: pass node 0's IP address or a hostname every node resolves to it."
        )


def _only_external_interface(host: str, table: dict[str, tuple[str, ...]]) -> tuple[str, str]:
    external = non_loopback_interfaces(table)
    if len(external) == 1:
        name, addresses = next(iter(external.items()))
        return name, next(a for a in addresses if ":" not in a and not is_loopback(a))
    raise NetworkError(
        f"{host!r} resolves to a loopback address on this node, and this node has "
        f"{len(external)} external interface(s) ({_list_interfaces(external) or 'none'}), so phalanx cannot "
        f"tell which one the other nodes reach. HINT: pass --master-addr as an IP address, or set "
        f"{envvars.GLOO_SOCKET_IFNAME} (and {envvars.NCCL_SOCKET_IFNAME}) to the right interface."
    )


def _list_interfaces(table: Mapping[str, tuple[str, ...]]) -> str:
    return ", ".join(f"{name} ({'/'.join(addresses)})" for name, addresses in table.items())
