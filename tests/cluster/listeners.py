"""Which local addresses listen on a TCP port, read from /proc/net/tcp{,6} (no ss needed)."""

import ipaddress
import struct


def listening_addresses(port: int) -> list[str]:
    found = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, len(raw), 4))
            found.append(str(ipaddress.ip_address(words)) if width == 8 else str(ipaddress.IPv6Address(words)))
    return found
