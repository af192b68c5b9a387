"""Which local address and interface reach the master, and whether this node *is* the master.

Why: gloo and NCCL pick their interface from the hostname, which on many hosts resolves to
127.0.0.1 (or to the wrong one of several interfaces); the other nodes then cannot connect. The
kernel already knows the right answer: a UDP `connect()` to the master's address selects a route
and a source address without sending a packet; the interface owning that address is the one to use.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import socket
import struct

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1


class NetworkError(RuntimeError):
    """The master cannot be resolved or reached from this node; the message says what to check."""


@dataclasses.dataclass(frozen=True)
class Route:
    """How this node reaches `host`."""

    host: str
    """The address as the user wrote it (hostname or IP)."""
    addresses: tuple[str, ...]
    """What `host` resolves to here, IPv4 first."""
    address: str
    """The resolved address used (the first one a route exists to)."""
    local_addr: str
    """This node's source address towards `address`."""
    ifname: str
    """The interface owning `local_addr`."""
    is_local: bool
    """True when this node owns `address` (it hosts the store)."""


def resolve(host: str) -> tuple[str, ...]:
    """Addresses `host` resolves to (IPv4 first, no repeats); NetworkError when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as error:
        raise NetworkError(
            f"cannot resolve {host!r}: {error.strerror}. HINT: use the master's IP address, or add "
            f"{host} to /etc/hosts or DNS on every node (check with `getent hosts {host}`)."
        ) from None
    found: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            address = str(info[4][0])
            if info[0] == family and address not in found:
                found.append(address)
    return tuple(found)


def source_address(address: str) -> str:
    """This node's address on the route to `address` (UDP connect: routes, sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))  # port 9 (discard); UDP connect sends no packet
        except OSError as error:
            raise NetworkError(f"no route from this node to {address}: {error.strerror}") from None
        return str(sock.getsockname()[0])


def interface_addresses() -> dict[str, tuple[str, ...]]:
    """Interface name -> its addresses (IPv4 via ioctl, IPv6 from /proc/net/if_inet6), up ones only."""
    table: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)[16:18])[0]
            except OSError:
                continue  # vanished between listing and asking
            if not flags & _IFF_UP:
                continue
            table[name] = []
            try:
                table[name].append(socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24]))
            except OSError:
                pass  # EADDRNOTAVAIL: an up interface with no IPv4 address is a normal state
    try:
        with open("/proc/net/if_inet6") as lines:
            for line in lines:
                fields = line.split()
                if len(fields) >= 6 and fields[5] in table:
                    table[fields[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except FileNotFoundError:
        pass  # kernel without IPv6
    return {name: tuple(addresses) for name, addresses in table.items()}


def interface_of(address: str, table: dict[str, tuple[str, ...]]) -> str | None:
    """The interface owning `address`, or None."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in table.items():
        if any(ipaddress.ip_address(own) == wanted for own in addresses):
            return name
    return None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def route_to(host: str, table: dict[str, tuple[str, ...]] | None = None) -> Route:
    """How this node reaches `host`; NetworkError naming every address tried when none is routable."""
    table = interface_addresses() if table is None else table
    addresses = resolve(host)
    failures: list[str] = []
    for address in addresses:
        try:
            local = source_address(address)
        except NetworkError as error:
            failures.append(str(error))
            continue
        owned = is_loopback(address) or interface_of(address, table) is not None
        ifname = interface_of(local, table) or ("lo" if is_loopback(local) else "")
        if not ifname:
            failures.append(f"{address}: source address {local} belongs to no interface that is up")
            continue
        return Route(host, addresses, address, local, ifname, owned)
    raise NetworkError(
        f"{host!r} resolves to {', '.join(addresses)}, but none is reachable from this node "
        f"({'; '.join(failures)}). HINT: check the address and this node's routes (`ip route get ADDRESS`)."
    )


def non_loopback_interfaces(table: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Up interfaces with at least one non-loopback IPv4 address."""
    return {
        name: addresses
        for name, addresses in table.items()
        if any(":" not in a and not is_loopback(a) for a in addresses)
    }
