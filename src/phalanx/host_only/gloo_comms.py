"""FSDP2's two collectives on gloo, done the way gloo does them cheaply (measured on 2 CPU ranks,
torch 2.13, CPU time per call):

- Gradients: gloo has no reduce-scatter worth the name: its reduce_scatter_tensor costs what an
  all_reduce of the whole input does (12 MiB: 9.6 and 9.0 ms; 24 MiB: 19.7 and 19.9 ms), although it
  needs only half the data moved. An all-to-all of FSDP2's reduce-scatter input (laid out rank by
  rank) hands each rank every peer's copy of its own chunk, moving what a reduce-scatter moves;
  summing those copies with this rank's own, in rank order, gives the same sums (on 2 ranks bit for
  bit: a + b either way) for 5.5 and 11.7 ms. The price is a transient buffer of the peers' copies
  ((world - 1) / world of the input) while the unit's gradients are reduced.
- Parameters: gloo's all_gather_into_tensor gathers into a buffer of its own, allocated by its
  worker thread, and copies that into the output (twice the page faults of the output alone):
  4 MiB gathered, 4.2 ms; 16 MiB, 18.7 ms. Each rank's chunk sent straight into its place on every
  peer moves the same bytes with no second buffer: 2.4 and 10.7 ms (as one broadcast per rank). A
  zero3 step of the small-vocab encoder: 202.2 -> 191.0 ms (median of 8 alternating rounds), the
  parameters after it bit-equal. zero1's gather of its updated chunks does the same (zero1_buckets.py).
  The chunks go point to point (`isend`/`irecv`), not by broadcasts: gloo runs a collective on its
  worker threads, a handoff that costs ~0.2 ms of CPU per call on these 2-core machines whatever
  its size, where a send is posted from the calling thread (34 one-element calls: 6.4-9.9 ms as
  broadcasts, 0.9-2.0 ms as sends and receives; zero1's gather of the encoder's 17 large
  parameters, 16.8 MB: 5.6-7.7 ms as broadcasts, 3.9-5.9 ms point to point).

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
from phalanx.runtime import collectives

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
        """reduce_scatter(output, input) computed as an all-to-all of `input` (each peer's copy of this
        rank's chunk received into a buffer of the peers' copies only), then their sum with this
        rank's own, in rank order (divided by the world for AVG)."""

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
        ) -> Any:
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # e.g. a pre-multiplied sum
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            world = dist.get_world_size(group)
            size = ((world - 1) * output_tensor.numel(),)
            peers = self.allocate(size, dtype=input_tensor.dtype, device=input_tensor.device) if world > 1 else None
            reduce_scatter_single(output_tensor, input_tensor, group, peers)
            if op == dist.ReduceOp.AVG:
                output_tensor.div_(world)
            return None


if AllGather is not None:

    class PeerAllGather(_Buffered, AllGather):  # type: ignore[misc,valid-type]
        """all_gather(output, input) as each rank's chunk sent straight into its place in every peer's
        output (FSDP2's input is already this rank's chunk of it). It returns when the gather is done,
        async_op or not: FSDP2 waits only on a c10d Work, and on CPU the ranks' compute and gloo's
        threads share the cores, so a prefetch overlaps little (the step above is with it)."""

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
        ) -> Any:
            all_gather_single(output_tensor, input_tensor, group)
            return None


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """torch's all_gather_single (`output`: the ranks' equal chunks along dim 0, `input`: this rank's),
    returning when done; on gloo each rank's chunk sent straight into its place on every peer (`input`
    may already be this rank's chunk of `output`: no copy then)."""
    if not engages(dist.get_backend(group)):
        collectives.all_gather_single(output.view(-1), input.reshape(-1), group=group)  # flat: any shapes
        return
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.chunk(world)
    if chunks[me].data_ptr() != input.data_ptr():
        chunks[me].copy_(input.view_as(chunks[me]))
    exchange(((chunk, i) for i, chunk in enumerate(chunks)), group)  # rank i's chunk from rank i


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, group: Any, peers: torch.Tensor | None = None
) -> None:
    """torch's reduce_scatter_single with SUM (`input`: the ranks' equal chunks along dim 0, `output`:
    the sum of every rank's copy of this rank's chunk), returning when done. On gloo an all-to-all
    point to point: every peer's copy of this rank's chunk received (into `peers`, (world - 1) x the
    output's elements, where given), then summed with this rank's own in rank order."""
    if not engages(dist.get_backend(group)):
        collectives.reduce_scatter_single(output.view(-1), input.reshape(-1), group=group)  # flat: any shapes
        return
    world, me = dist.get_world_size(group), dist.get_rank(group)
    rows, out = input.reshape(world, -1), output.view(-1)
    if world == 1:
        out.copy_(rows[0])
        return
    if peers is None:
        peers = out.new_empty((world - 1) * out.numel())
    received = list(peers.view(world - 1, -1))
    received.insert(me, rows[me])
    all_to_all(received, list(rows), group)
    torch.add(received[0], received[1], out=out)  # summed in rank order, as gloo's own does
    for part in received[2:]:
        out.add_(part)


def all_to_all(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: Any) -> None:
    """all_to_all_single over equal parts (`inputs[r]` to rank r, `outputs[r]` from rank r; this
    rank's own part copied unless it is the same tensor), point to point: as gloo's, without its
    worker-thread handoff."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    if outputs[me] is not inputs[me]:
        outputs[me].copy_(inputs[me])
    works = []
    for r in range(world):
        if r != me:
            works += [
                dist.isend(inputs[r], group=group, group_dst=r),
                dist.irecv(outputs[r], group=group, group_src=r),
            ]
    for work in works:
        work.wait()


def exchange(parts: Iterable[tuple[torch.Tensor, int]], group: Any) -> None:
    """Each (tensor, owner's rank in `group`): the owner's values sent into every peer's tensor, in
    place, point to point; all posted, then all waited for. Every rank passes the same parts in the
    same order (the sends and receives between two ranks pair up in the order they are posted);
    an empty tensor is skipped on every rank alike."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    works = []
    for tensor, owner in parts:
        if tensor.numel() == 0:
            continue
        if owner == me:
            works += [dist.isend(tensor, group=group, group_dst=r) for r in range(world) if r != me]
        else:
            works.append(dist.irecv(tensor, group=group, group_src=owner))
    for work in works:
        work.wait()


def use_gloo_collectives(units: Iterable[Any], roots: Iterable[Any], backend: str) -> bool:
    """On gloo, make each fully_shard-ed module (units and roots) reduce its gradients with
    AllToAllReduceScatter and gather its parameters with PeerAllGather, both reusing one
    StepBuffers, emptied when a root's forward ends and when the backward ends. Nothing on any other
    backend (host_only.engages): NCCL's own collectives are used there."""
    if not engages(backend) or ReduceScatter is None or AllGather is None:
        return False
    buffers = StepBuffers()
    reduce, gather = AllToAllReduceScatter(buffers), PeerAllGather(buffers)
    roots = list(roots)
    for module in [*units, *roots]:
        module.set_custom_reduce_scatter(reduce)
        module.set_custom_all_gather(gather)
    for root in roots:
        buffers.release_after_forward(root)
    return True
