"""zero3's floor on CPU/gloo: the CPU time a sharded step cannot avoid, from the bytes it moves.

Per step, zero3 as phalanx applies it all-gathers every unit's parameters for the forward (the root
unit's too), again for the backward (all but the last unit, which stays gathered, and the root,
which stays from forward to backward; on gloo a broadcast per rank into the output), reduces every
unit's gradients (on gloo an all-to-all, then the sum of this rank's chunks: host_only/gloo_comms.py),
and exchanges the root embedding's looked-up rows (token ids and outputs forward, output gradients
backward); each gather is copied out into the parameters and each gradient into the reduce
buffer. ddp instead all-reduces every gradient in 25 MiB buckets.

Every buffer is allocated as zero3 allocates it: the unsharded parameters at each gather and the
sharded gradient at each reduction per use, as FSDP2 does; the all-gather output and the reduce
buffers from the step's `StepBuffers`, as phalanx's gloo collectives take them (a freed one handed
on to the next unit of its size, all dropped when the step ends); ddp's buckets persist. So the
floor includes what memory costs under the process's host memory setting: fresh pages, zeroed by
the kernel, where `host_mmap_threshold` gives freed buffers back to the system (phalanx's default,
1MiB), glibc's reused heap where it is 0.

The optimizer: ddp's step updates every parameter, a sharded rank's only its 1/N. The floor takes
ddp's optimizer step as timed inside its steps, scaled by what AdamW over this rank's shards costs
against AdamW over the whole model, both timed alone (`optimizer_ms`); before this the floor kept
ddp's whole step and stood that much (about 10 ms on the small-vocab encoder, 2 ranks) above what a
sharded step needs.

floor = phalanx ddp's CPU time per step + those collectives and copies - ddp's all-reduce - ddp's
optimizer step + that step scaled to the shards, the collectives timed alone on the same ranks
(rank 0's CPU time, median of `reps`): the step zero3 would take if sharding cost nothing beyond
moving its bytes, at this machine's per-collective latency.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.runtime.collectives import all_gather_single

DDP_BUCKET_BYTES = 25 * 2**20


def _units(model: nn.Module) -> tuple[list[int], int, nn.Embedding | None]:
    """Numel of each unit phalanx shards, of the root unit, and the root embedding it row-shards."""
    from phalanx.model.units import shard_units

    units = shard_units(model, None)
    in_units = sum(p.numel() for u in units for p in u.parameters())
    embedding = next((m for m in model.children() if isinstance(m, nn.Embedding)), None)
    root = sum(p.numel() for p in model.parameters()) - in_units - (embedding.weight.numel() if embedding else 0)
    return [sum(p.numel() for p in u.parameters()) for u in units], root, embedding


def _cpu_ms(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm up gloo's pairs and buffers
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1000)
    return sorted(times)[reps // 2]


def comm_ms(model: nn.Module, batch: int, seq: int, reps: int = 5) -> tuple[float, float]:
    """(zero3's collectives and copies, ddp's all-reduce) per step, CPU ms, timed alone."""
    from phalanx.host_only.gloo_comms import AllToAllReduceScatter, PeerAllGather
    from phalanx.host_only.step_buffers import StepBuffers

    world, rank = dist.get_world_size(), dist.get_rank()
    units, root, embedding = _units(model)
    buffers = StepBuffers()  # as zero3 gathers and reduces on gloo
    gather_comm, reduce_comm = PeerAllGather(buffers), AllToAllReduceScatter(buffers)

    shards = {n: torch.randn(math.ceil(n / world)) for n in set(units + [root])}  # this rank's parameters
    grads = {n: torch.randn(n) for n in set(units + [root])}  # autograd's unsharded gradients (ddp's too)

    def gather(n: int) -> None:
        shard = shards[n]
        per = shard.numel()
        gathered = gather_comm.allocate((per * world,), dtype=torch.float32, device=torch.device("cpu"))
        gathered[rank * per : (rank + 1) * per].copy_(shard)
        gather_comm(gathered, gathered[rank * per : (rank + 1) * per], dist.group.WORLD)
        torch.empty(n).copy_(gathered[:n])

    def reduce(n: int) -> None:
        laid_out = reduce_comm.allocate((shards[n].numel() * world,), dtype=torch.float32, device=torch.device("cpu"))
        laid_out[:n].copy_(grads[n])
        reduce_comm(torch.empty(shards[n].numel()), laid_out, dist.group.WORLD, dist.ReduceOp.SUM)

    tokens = torch.zeros(batch, seq, dtype=torch.int64)
    dim = embedding.embedding_dim if embedding is not None else 0
    output_grads = torch.randn(batch, seq, dim)

    def zero3() -> None:
        if embedding is not None:
            all_gather_single(torch.empty(world * batch, seq, dtype=torch.int64), tokens)
            dist.all_reduce(torch.zeros(world * batch, seq, dim))  # the rows each rank looked up
        for n in units + [root]:
            gather(n)
        for n in units[:-1]:
            gather(n)
        for n in units + [root]:
            reduce(n)
        if embedding is not None:
            all_gather_single(torch.empty(world * batch, seq, dim), output_grads)
        buffers.release()  # as the end of a backward does

    total = sum(p.numel() for p in model.parameters())
    per_bucket = DDP_BUCKET_BYTES // 4
    bucket_list = [torch.randn(min(per_bucket, total - i)) for i in range(0, total, per_bucket)]

    def ddp() -> None:
        for bucket in bucket_list:
            dist.all_reduce(bucket)

    return _cpu_ms(zero3, reps), _cpu_ms(ddp, reps)


def optimizer_ms(model: nn.Module, reps: int = 5) -> tuple[float, float]:
    """(AdamW's step over every parameter, over this rank's 1/N shard of each) CPU ms, timed alone."""
    world = dist.get_world_size()

    def timed(sizes: list[int]) -> float:
        params = [nn.Parameter(torch.randn(n)) for n in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        return _cpu_ms(optimizer.step, reps)

    sizes = [p.numel() for p in model.parameters()]
    return timed(sizes), timed([math.ceil(n / world) for n in sizes])
