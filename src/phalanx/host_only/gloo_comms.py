"""FSDP2's two collectives on gloo, done the way gloo does them cheaply (measured on 2 CPU ranks,
torch 2.13, CPU time per call):

- Gradients: gloo has no reduce-scatter worth the name: its reduce_scatter_tensor costs what an
  all_reduce of the whole input does (12 MiB: 9.6 and 9.0 ms; 24 MiB: 19.7 and 19.9 ms), although it
  needs only half the data moved. An all-to-all of FSDP2's reduce-scatter input (laid out rank by
  rank) hands each rank every peer's copy of its own chunk, moving what a reduce-scatter moves;
  summing those copies here gives the same sums (on 2 ranks bit for bit: a + b either way) for 5.5
  and 11.7 ms. The price is a transient buffer of the input's size while the unit's gradients are
  reduced.
- Parameters: gloo's all_gather_into_tensor gathers into a buffer of its own, allocated by its
  worker thread, and copies that into the output (twice the page faults of the output alone):
  4 MiB gathered, 4.2 ms; 16 MiB, 18.7 ms. One broadcast per rank, each straight into that rank's
  chunk of the output, moves the same bytes with no second buffer: 2.4 and 10.7 ms. A zero3 step
  of the small-vocab encoder: 202.2 -> 191.0 ms (median of 8 alternating rounds), the parameters
  after it bit-equal. zero1's gather of its updated chunks does the same (zero1_buckets.py).

Both draw their buffers from one `StepBuffers` per model, which hands a unit's freed buffer on to the
next unit of its size within a step (host_only/step_buffers.py).

Host-only (phalanx/host_only/): `use_gloo_collectives` engages on gloo only; on NCCL, FSDP2 and zero1
use torch's own reduce-scatter and all-gather.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from phalanx.host_only import engages
from phalanx.host_only.step_buffers import StepBuffers

try:  # FSDP2's pluggable collectives (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2's own collectives stay
    AllGather = ReduceScatter = None  # type: ignore[assignment,misc]


class _Buffered:
    """FSDP2's `allocate` for a collective's buffers, from the step's shared pool."""

    def __init__(self, buffers: StepBuffers | None = None) -> None:
        self.buffers = StepBuffers() if buffers is None else buffers

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.buffers.take(size, dtype, device)


if ReduceScatter is not None:

    class AllToAllReduceScatter(_Buffered, ReduceScatter):  # type: ignore[misc,valid-type]
        """reduce_scatter(output, input) computed as all_to_all(input), then the sum of the copies
        of this rank's chunk (divided by the world for AVG)."""

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
        ) -> Any:
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # e.g. a pre-multiplied sum
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            world = dist.get_world_size(group)
            copies = self.allocate(input_tensor.shape, dtype=input_tensor.dtype, device=input_tensor.device)
            dist.all_to_all_single(copies, input_tensor, group=group)
            torch.sum(copies.view(world, *output_tensor.shape), 0, out=output_tensor)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(world)
            return None


if AllGather is not None:

    class BroadcastAllGather(_Buffered, AllGather):  # type: ignore[misc,valid-type]
        """all_gather(output, input) as one broadcast per rank, each straight into its chunk of the
        output (FSDP2's input is already this rank's chunk of it). It returns when the gather is done,
        async_op or not: FSDP2 waits only on a c10d Work, and on CPU the ranks' compute and gloo's
        threads share the cores, so a prefetch overlaps little (the step above is with it)."""

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
        ) -> Any:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            chunks = output_tensor.chunk(world)
            if chunks[rank].data_ptr() != input_tensor.data_ptr():
                chunks[rank].copy_(input_tensor)
            gather_by_broadcasts(chunks, group)
            return None


def gather_by_broadcasts(chunks: Sequence[torch.Tensor], group: Any) -> None:
    """An all-gather as gloo does it cheaply: rank i's chunk (already in `chunks[i]` on rank i)
    broadcast from each rank straight into its place, no buffer of gloo's own; returns when done."""
    broadcasts(((chunk, i) for i, chunk in enumerate(chunks)), group)


def broadcasts(parts: Iterable[tuple[torch.Tensor, int]], group: Any) -> None:
    """Each (tensor, source rank in `group`) broadcast in place, all started, then all waited for."""
    works = [dist.broadcast(tensor, group=group, group_src=src, async_op=True) for tensor, src in parts]
    for work in works:
        work.wait()


def use_gloo_collectives(units: Iterable[Any], roots: Iterable[Any], backend: str) -> bool:
    """On gloo, make each fully_shard-ed module (units and roots) reduce its gradients with
    AllToAllReduceScatter and gather its parameters with BroadcastAllGather, both reusing one
    StepBuffers, emptied when a root's forward ends and when the backward ends. Nothing on any other
    backend (host_only.engages): NCCL's own collectives are used there."""
    if not engages(backend) or ReduceScatter is None or AllGather is None:
        return False
    buffers = StepBuffers()
    reduce, gather = AllToAllReduceScatter(buffers), BroadcastAllGather(buffers)
    roots = list(roots)
    for module in [*units, *roots]:
        module.set_custom_reduce_scatter(reduce)
        module.set_custom_all_gather(gather)
    for root in roots:
        buffers.release_after_forward(root)
    return True
