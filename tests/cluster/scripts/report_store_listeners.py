"""Worker script: rank 0 prints the addresses listening on the store's port (MASTER_PORT), and
whether a TCP connection to that port on each of the machine's non-loopback addresses is refused.
With --init, after joining the process group (whose store the workers may open themselves)."""

import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from listeners import listening_addresses  # noqa: E402


def reachable_on(port):
    """Non-loopback addresses of this machine where host:port accepts a connection."""
    from phalanx.cluster.network import interface_addresses, non_loopback_interfaces

    found = []
    for addresses in non_loopback_interfaces(interface_addresses()).values():
        for address in addresses:
            if address.startswith("fe80:"):
                continue  # link-local needs a scope id
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                if sock.connect_ex((address, port)) == 0:
                    found.append(address)
    return found


if "--init" in sys.argv:  # the workers open the group's store themselves (torch's etcd rendezvous)
    import torch.distributed as dist

    dist.init_process_group("gloo")
if os.environ["RANK"] == "0":
    port = int(os.environ["MASTER_PORT"])
    print("LISTENERS", os.environ["MASTER_ADDR"], port, ",".join(listening_addresses(port)))
    print("REACHABLE_ELSEWHERE", ",".join(reachable_on(port)) or "none")
if "--init" in sys.argv:
    dist.barrier()  # rank 0's store serves the others until every rank has read its address
    dist.destroy_process_group()
