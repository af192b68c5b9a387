"""A live all-reduce among N local processes, with a hard timeout and its measured bandwidth.

Processes join over a file:// store (no port to collide with), run a few warm-up and timed
all-reduces of `size_mb` MiB, and rank 0 reports the median time. A hang (the failure doctor exists
to catch) ends at `timeout_s`: the processes are killed and the finding says so.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time

from phalanx.doctor.findings import FAIL, OK, Finding

TIMED_ROUNDS = 5


def _worker(rank: int, world_size: int, init_file: str, size_mb: float, backend: str, queue) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        tensor = torch.ones(int(size_mb * 2**20 // 4), dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(tensor)
        times = []
        for _ in range(TIMED_ROUNDS):
            tensor.fill_(1.0)
            if backend == "nccl":
                torch.cuda.synchronize()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if backend == "nccl":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        correct = bool(torch.all(tensor == world_size).item())
        if rank == 0:
            queue.put({"seconds": statistics.median(times), "correct": correct})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_allreduce(nproc: int, size_mb: float, timeout_s: float, backend: str = "gloo") -> Finding:
    """Start `nproc` processes, all-reduce, report algorithm and bus bandwidth (GB/s)."""
    name = f"all-reduce ({nproc} x {backend})"
    method = "spawn" if backend == "nccl" else "fork"  # CUDA must never be forked
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="phalanx-doctor-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, nproc, init_file, size_mb, backend, queue), daemon=True)
            for r in range(nproc)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.1, timeout_s - (time.monotonic() - start)))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
    if hung:
        return Finding(
            name,
            FAIL,
            f"did not finish within {timeout_s:g} s (ranks {hung} still running): a launch would hang",
            "run with TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL_DEBUG=INFO to see where it stops; "
            "check GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME",
            {"timeout_s": timeout_s},
        )
    if any(codes) or queue.empty():
        return Finding(
            name,
            FAIL,
            f"processes exited with codes {codes}",
            "run a 2-process `phalanx run` of a trivial script to see the error",
            {"exit_codes": codes},
        )
    result = queue.get()
    size = size_mb * 2**20
    algbw = size / result["seconds"] / 1e9
    busbw = algbw * 2 * (nproc - 1) / nproc
    data = {
        "nproc": nproc,
        "backend": backend,
        "size_mb": size_mb,
        "seconds": result["seconds"],
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "correct": result["correct"],
        "total_s": time.monotonic() - start,
    }
    if not result["correct"]:
        return Finding(name, FAIL, "the all-reduce returned wrong values", "report this: the backend is broken", data)
    return Finding(
        name,
        OK,
        f"{size_mb:g} MiB in {result['seconds'] * 1e3:.2f} ms: algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s",
        data=data,
    )
