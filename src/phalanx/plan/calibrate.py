"""`phalanx plan --measure-profile FILE`: this machine's device profile, measured (~10 s).

Two ranks on this machine, as `phalanx run` starts them on a CPU host (gloo over loopback, the
cores split between them): each rank times an fp32
matmul while the other does the same (the rate a rank gets while its peer computes), then a gloo
all-reduce of 4 MiB (bandwidth) and of one element (the latency of a call). The result is a
DeviceProfile (plan/device_profiles.py) written as JSON. torch is imported when called.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from phalanx.plan.device_profiles import DeviceProfile

MATMUL = 512  # a transformer's matmuls on CPU at the widths a CPU job trains
STREAM = 8 * 2**20  # elements of each tensor of the memory-bandwidth add (32 MiB: beyond the caches)
BLOCK = (256, 4, 16, 32)  # the achievable rate's transformer block: width, heads, rows, tokens a row
BUS = 4 * 2**20  # bytes of the bandwidth all-reduce
WORLD = 2


def measure(seconds: float = 10.0) -> DeviceProfile:
    """This machine's profile from a 2-rank run of about `seconds`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="phalanx-calibrate-") as tmp:
        mp.start_processes(_rank, args=(tmp, seconds), nprocs=WORLD, join=True, start_method="spawn")
        return profile(json.loads((Path(tmp) / "figures.json").read_text()))


def profile(figures: dict[str, float]) -> DeviceProfile:
    """The profile of `figures` (figures_in_group's)."""
    return DeviceProfile(
        name="cpu (measured)",
        peak_flops=figures["flops"],
        matmul_efficiency=min(1.0, figures["block_flops"] / figures["flops"]),
        intra_bandwidth=figures["bandwidth"],
        inter_bandwidth=figures["bandwidth"],
        intra_latency=figures["latency"],
        inter_latency=figures["latency"],
        ranks_per_node=os.cpu_count() or WORLD,
        dtype_bytes=4,  # fp32, as a CPU job trains
        overlap=0.0,  # gloo's work and the backward share the same cores
        memory_bandwidth=figures["memory"],
        source=f"measured by phalanx plan --measure-profile with {WORLD} ranks on {os.cpu_count()} cores",
    )


def figures_in_group(seconds: float) -> dict[str, float]:
    """The ranks of the default process group measure together, in about `seconds`: each rank's matmul
    FLOP/s (the peak), the FLOP/s a transformer block's forward and backward reach (model/flops.py's
    count: the achievable fraction of the peak, with the kernels between the matmuls), the memory
    bandwidth of an add over tensors larger than the caches (the optimizer step's), the all-reduce's
    bus bandwidth and its latency per call, averaged over the ranks (the same on every rank)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    a = torch.randn(MATMUL, MATMUL)
    flops = 2 * MATMUL**3 / _timed(lambda: a @ a, seconds * 0.2)
    block_flops = _block_flops(seconds * 0.2)
    x, y, z = torch.ones(STREAM), torch.ones(STREAM), torch.empty(STREAM)
    memory = 3 * 4 * STREAM / _timed(lambda: torch.add(x, y, out=z), seconds * 0.1)  # two reads, one write
    big = torch.ones(BUS // 4)
    per_call = _timed(lambda: dist.all_reduce(big), seconds * 0.3)
    small = torch.ones(1)
    latency = _timed(lambda: dist.all_reduce(small), seconds * 0.2)
    bandwidth = 2 * (world - 1) / world * BUS / max(per_call - latency, 1e-9)
    rates = torch.tensor([flops, block_flops, memory, bandwidth, latency], dtype=torch.float64)
    dist.all_reduce(rates)
    return dict(zip(("flops", "block_flops", "memory", "bandwidth", "latency"), (rates / world).tolist()))


def _block_flops(seconds: float) -> float:
    """FLOP/s of one nn.TransformerEncoderLayer's forward and backward, counted as model/flops.py counts."""
    import torch

    from phalanx.model import flops

    width, heads, rows, tokens = BLOCK
    block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
    x = torch.randn(rows, tokens, width)

    def step() -> None:
        block(x).sum().backward()

    count = flops.transformer_shape(block).flops_per_token(tokens) * rows * tokens
    return count / _timed(step, seconds)


def _rank(rank: int, tmp: str, seconds: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    try:
        figures = figures_in_group(seconds)
        if rank == 0:
            (Path(tmp) / "figures.json").write_text(json.dumps(figures))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _timed(fn, seconds: float) -> float:  # noqa: ANN001
    """Seconds per call of `fn`, the ranks starting together; as many calls as fit in `seconds`
    (the same count on every rank, from a probe of 5 calls agreed by all: collectives must match)."""
    import torch
    import torch.distributed as dist

    probe = torch.tensor([_run(fn, 5) / 5], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    count = max(5, int(seconds / max(float(probe), 1e-9)))
    return _run(fn, count) / count


def _run(fn, count: int) -> float:  # noqa: ANN001
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        fn()
    dist.barrier()
    return time.perf_counter() - start
