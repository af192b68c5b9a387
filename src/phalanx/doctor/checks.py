"""The machine checks behind `phalanx doctor`; each returns Findings and never raises for a problem.

Inputs are explicit (an environment mapping, ports, an address) so tests can stage a busy port, a
bogus CUDA_VISIBLE_DEVICES or an unresolvable master without touching the real environment.
"""

from __future__ import annotations

import os
import re
import resource
import socket
from typing import Mapping

from phalanx import envvars
from phalanx.cluster import network, slurm
from phalanx.doctor.findings import FAIL, OK, WARN, Finding

MIN_SHM_BYTES = 1 << 30
MIN_OPEN_FILES = 4096
_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def check_versions() -> list[Finding]:
    import torch
    import torch.distributed as dist

    cuda = torch.version.cuda
    nccl = None
    if cuda and torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    detail = f"torch {torch.__version__}, CUDA {cuda or 'none (CPU build)'}, NCCL {nccl or 'none'}, backends: {', '.join(backends)}"
    data = {"torch": torch.__version__, "cuda": cuda, "nccl": nccl, "backends": backends}
    if "gloo" not in backends:
        return [Finding("versions", FAIL, detail, "install a torch build with distributed support (gloo)", data)]
    return [Finding("versions", OK, detail, data=data)]


def physical_gpu_count() -> int:
    """NVIDIA GPUs the driver knows, independent of CUDA_VISIBLE_DEVICES (0 without a driver)."""
    try:
        return len(os.listdir(_NVIDIA_GPUS))
    except FileNotFoundError:
        return 0


def check_gpus(env: Mapping[str, str], num_visible: int, num_physical: int) -> list[Finding]:
    """CUDA_VISIBLE_DEVICES against the GPUs that exist and the GPUs CUDA sees."""
    raw = env.get(envvars.CUDA_VISIBLE_DEVICES)
    data = {"cuda_visible_devices": raw, "visible": num_visible, "physical": num_physical}
    if raw is None:
        detail = f"{num_visible} GPU(s) visible" + (" (CPU-only: workers use gloo)" if num_visible == 0 else "")
        return [Finding("gpus", OK, detail, data=data)]
    entries = [item.strip() for item in raw.split(",") if item.strip()]
    bad = [e for e in entries if not re.fullmatch(r"\d+|GPU-[0-9a-fA-F-]+|MIG-[\w/-]+", e)]
    fix_hint = (
        (f"unset {envvars.CUDA_VISIBLE_DEVICES}, or list indices 0..{num_physical - 1} (see `nvidia-smi -L`)")
        if num_physical
        else f"unset {envvars.CUDA_VISIBLE_DEVICES}"
    )
    if bad:
        return [
            Finding(
                "gpus",
                FAIL,
                f"{envvars.CUDA_VISIBLE_DEVICES}={raw!r} has invalid entries {bad}: CUDA stops reading the "
                "list at the first bad entry, so the GPUs after it are silently hidden",
                fix_hint,
                data,
            )
        ]
    if len(set(entries)) != len(entries):
        return [Finding("gpus", FAIL, f"{envvars.CUDA_VISIBLE_DEVICES}={raw!r} lists a GPU twice", fix_hint, data)]
    numeric = [int(e) for e in entries if e.isdigit()]
    missing = [i for i in numeric if i >= num_physical]
    if num_physical == 0 and entries:
        return [
            Finding(
                "gpus",
                WARN,
                f"{envvars.CUDA_VISIBLE_DEVICES}={raw!r} is set but this machine has no NVIDIA GPU: "
                "runs use the CPU and gloo",
                fix_hint,
                data,
            )
        ]
    if missing or num_visible < len(entries):
        return [
            Finding(
                "gpus",
                FAIL,
                f"{envvars.CUDA_VISIBLE_DEVICES}={raw!r} lists {len(entries)} GPU(s) but CUDA sees "
                f"{num_visible} of this machine's {num_physical}"
                + (f" (no GPU {', '.join(map(str, missing))})" if missing else ""),
                fix_hint,
                data,
            )
        ]
    return [Finding("gpus", OK, f"{num_visible} GPU(s) visible ({envvars.CUDA_VISIBLE_DEVICES}={raw})", data=data)]


def check_ports(ports: list[int], required: set[int]) -> list[Finding]:
    """Each port must be free to bind; a busy `required` port (one a launch will use) is a failure."""
    from phalanx.launch.ports import is_port_free

    findings = []
    for port in ports:
        if is_port_free(port):
            findings.append(Finding(f"port {port}", OK, "free", data={"port": port, "free": True}))
            continue
        needed = port in required
        findings.append(
            Finding(
                f"port {port}",
                FAIL if needed else WARN,
                "in use on this machine" + (" (the port the launch will use)" if needed else " (torchrun's default)"),
                f"find the owner with `ss -ltnp 'sport = :{port}'` and stop it, or pick another --master-port "
                "(on one node, phalanx run without --master-port picks a free port itself)",
                {"port": port, "free": False},
            )
        )
    return findings


def check_hostname() -> list[Finding]:
    """What this host's name resolves to: gloo's interface when GLOO_SOCKET_IFNAME is unset."""
    name = socket.gethostname()
    try:
        addresses = network.resolve(name)
    except network.NetworkError as error:
        return [Finding("hostname", FAIL, str(error), f"add `{name}` to /etc/hosts", {"hostname": name})]
    data = {"hostname": name, "addresses": list(addresses)}
    ifname = network.interface_of(addresses[0], network.interface_addresses()) or "unknown"
    data["ifname"] = ifname
    detail = f"{name} resolves to {', '.join(addresses)}: without GLOO_SOCKET_IFNAME gloo uses {ifname}"
    if all(network.is_loopback(a) for a in addresses):
        # Fine on one node, and phalanx run sets GLOO/NCCL_SOCKET_IFNAME across nodes; only a
        # hand-rolled multi-node torchrun would break, which is not a reason to fail here.
        detail += (
            "; across nodes phalanx run sets GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME from the route to "
            "the master (with plain torchrun, set them yourself)"
        )
    return [Finding("hostname", OK, detail, data=data)]


def check_master(master_addr: str | None, env: Mapping[str, str]) -> list[Finding]:
    """Resolve the master and name the interface/address gloo and NCCL would use to reach it."""
    if not master_addr:
        return [Finding("master", OK, "no master address given (single node: loopback)")]
    try:
        route = network.route_to(master_addr)
    except network.NetworkError as error:
        fix = str(error).split("HINT: ", 1)[-1] if "HINT: " in str(error) else "check the address"
        return [Finding("master", FAIL, str(error).split(" HINT: ")[0], fix, {"master_addr": master_addr})]
    chosen = env.get(envvars.GLOO_SOCKET_IFNAME) or route.ifname
    data = {
        "master_addr": master_addr,
        "address": route.address,
        "local_addr": route.local_addr,
        "ifname": chosen,
        "is_local": route.is_local,
    }
    detail = (
        f"{master_addr} -> {route.address}, reached from {route.local_addr} on {route.ifname}"
        f"{' (this node hosts the store)' if route.is_local else ''}; gloo/NCCL interface: {chosen}"
    )
    return [Finding("master", OK, detail, data=data)]


def check_shm(path: str = "/dev/shm") -> list[Finding]:
    try:
        stat = os.statvfs(path)
    except FileNotFoundError:
        return [
            Finding(
                "shm", WARN, f"{path} does not exist", "mount a tmpfs on /dev/shm (DataLoader workers and NCCL use it)"
            )
        ]
    size = stat.f_blocks * stat.f_frsize
    data = {"bytes": size}
    if size < MIN_SHM_BYTES:
        return [
            Finding(
                "shm",
                WARN,
                f"{path} is {size / 2**20:.0f} MiB: DataLoader workers and NCCL can run out",
                "docker: --shm-size=8g; otherwise `mount -o remount,size=8G /dev/shm`",
                data,
            )
        ]
    return [Finding("shm", OK, f"{path} is {size / 2**30:.1f} GiB", data=data)]


def check_open_files() -> list[Finding]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    data = {"soft": soft, "hard": hard}
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        return [
            Finding(
                "open files",
                WARN,
                f"limit {soft} (hard {hard}): many workers/DataLoader processes exhaust it",
                f"`ulimit -n {min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536}` before launching",
                data,
            )
        ]
    return [Finding("open files", OK, f"limit {soft}", data=data)]


def check_slurm(env: Mapping[str, str]) -> list[Finding]:
    if not slurm.in_slurm(env):
        return [Finding("slurm", OK, "not inside a SLURM allocation")]
    try:
        alloc = slurm.read_allocation(env)
        launch = slurm.launch_settings(env) if alloc.in_step or alloc.nnodes == 1 else None
    except slurm.SlurmError as error:
        text = str(error)
        return [
            Finding("slurm", FAIL, text.split(" HINT: ")[0], text.split("HINT: ", 1)[-1] if "HINT: " in text else "")
        ]
    detail = (
        f"job {alloc.job_id}: {alloc.nnodes} node(s) ({', '.join(alloc.hosts[:4])}), this is node "
        f"{alloc.node_rank}, master {alloc.master_addr}:{alloc.master_port}, GPUs on node: {alloc.gpus_on_node}"
    )
    if launch is None:
        return [
            Finding(
                "slurm",
                WARN,
                detail + "; in the batch script (no srun step)",
                "start phalanx run on every node: `srun --ntasks-per-node=1 phalanx run ...`",
            )
        ]
    return [Finding("slurm", OK, detail, data={"nnodes": launch.nnodes, "node_rank": launch.node_rank})]
