"""zero1's gradients reduce-scattered into each rank's own dim-0 chunk, not all-reduced (NCCL).

ZeRO-1 steps each rank's chunk of every parameter (strategies/optimizers/sharded_optimizer.py), so a rank needs
the reduced gradient of its own rows only. DDP's comm hook here packs each bucket rank by rank
(every parameter's rows of chunk r, padded to equal chunks: the layout zero1_buckets gathers the
updated chunks in) and reduce-scatters it; each rank receives the sums of its own rows and writes
their mean back in place into the bucket, so into `param.grad` (a view of it). With the all-gather
of the updated chunks after the step, a zero1 step moves the bytes of one all-reduce, where DDP's
all-reduce plus the gather move half as much again. A bucket goes in pieces of the gather's bucket
size (1/16 of the parameters' bytes, 1-64 MiB), through two buffers of that size per hook call.

An opt-in (`zero1_grads: reduce_scatter`), not the default: on gloo the reduce-scatter (an
all-to-all and a local sum, host_only/gloo_comms: gloo's own reduce_scatter_tensor costs a whole
all-reduce) plus the packing costs more CPU than DDP's in-place all-reduce (bench/guard.py's encoder,
4.2M fp32 parameters, 2 CPU ranks, 5 alternated rounds: a zero1 step took 165.8 ms of CPU with it,
146.5 with DDP's all-reduce, phalanx ddp 152.8; with gloo's reduce_scatter_tensor it took 0.71-0.79 of
ddp's speed), it is not yet measured on GPUs, and it changes what `.grad` holds (below), which code
reading whole gradients would not see.

The other ranks' rows of `param.grad` keep this rank's own unreduced contribution: only the owner's
rows are the gradient. So gradient clipping combines the owners' norms over the ranks (`norm`,
routed into torch's clip_grad_norm_ for the prepared model), and a bucket holding any parameter that
no zero1 optimizer steps by chunks (another optimizer, whole-tensor steps) is all-reduced as DDP
does; so is every bucket under a compression comm hook (strategies/ddp.py).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.host_only import gloo_comms
from phalanx.strategies.optimizers import zero1_buckets
from phalanx.strategies.optimizers.zero1_buckets import dim0_chunk


@dataclass(frozen=True)
class _GradSlot:
    """One parameter's gradient in a DDP bucket: elements [offset, offset + numel) of its buffer,
    split in dim-0 chunks as zero1 splits the parameter (what zero1_buckets.plan_buckets cuts)."""

    offset: int
    numel: int
    rows: int
    row_numel: int
    rows_per_rank: int
    replicated: bool  # a scalar: every rank steps it whole, so every rank receives all of it

    def span(self, rank: int, world: int, lo: int, hi: int) -> tuple[int, int]:
        """Elements of the bucket holding rows [lo, hi) of `rank`'s chunk (a scalar: all of it)."""
        if self.replicated:
            return self.offset, self.offset + self.numel
        start, end = dim0_chunk(self.rows, world, rank)
        a, b = min(start + lo, end), min(start + hi, end)
        return self.offset + a * self.row_numel, self.offset + b * self.row_numel


def _grad_slot(p: torch.Tensor, offset: int, world: int) -> _GradSlot:
    rows = p.shape[0] if p.dim() else 1
    row_numel = math.prod(p.shape[1:]) if p.dim() else 1
    return _GradSlot(
        offset, p.numel(), rows, row_numel, rows if p.dim() == 0 else math.ceil(rows / world), p.dim() == 0
    )


class Zero1Grads:
    """DDP's comm hook for zero1 (`hook`) and the norm of the gradients it leaves (`norm`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._sharded: dict[int, weakref.ref] = {}  # id(param) -> ref: stepped by chunk
        self._scattered: dict[int, bool] = {}  # id(param) -> whether its last reduction scattered it
        self._plans: dict[tuple[int, ...], list[zero1_buckets.Bucket] | None] = {}
        self._piece_numel = 1  # per rank: the gather's bucket size

    def shard(self, params: list[torch.Tensor]) -> None:
        """`params` are stepped by their owners' chunks (a zero1 optimizer over them): their
        buckets are reduce-scattered from the next backward on."""
        for p in params:
            self._sharded[id(p)] = weakref.ref(p)
        self._plans.clear()
        live = [ref() for ref in self._sharded.values() if ref() is not None]
        itemsize = live[0].element_size() if live else 4
        model_bytes = sum(p.numel() for p in live) * itemsize
        self._piece_numel = max(1, zero1_buckets.bucket_bytes(model_bytes) // (self.world * itemsize))

    def _plan(self, params: list[torch.Tensor]) -> list[zero1_buckets.Bucket] | None:
        key = tuple(id(p) for p in params)
        if key not in self._plans:
            slots, offset = [], 0
            for p in params:
                ref = self._sharded.get(id(p))
                if ref is None or ref() is not p or not p.is_contiguous():
                    self._plans[key] = None
                    return None
                slots.append(_grad_slot(p, offset, self.world))
                offset += p.numel()
            self._plans[key] = zero1_buckets.plan_buckets(slots, self._piece_numel)
        return self._plans[key]

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        """Reduce-scatter `bucket` (a done future of its buffer, the owner's rows reduced), or
        all-reduce it where a parameter in it is not stepped by chunks."""
        flat, params = bucket.buffer(), bucket.parameters()
        plan = self._plan(params) if self.world > 1 else None
        for p in params:
            self._scattered[id(p)] = plan is not None
        if plan is None:  # DDP's own all-reduce of the mean
            flat.div_(self.world)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        most = max(piece.numel for piece in plan)
        send, mine = flat.new_empty(self.world * most), flat.new_empty(most)
        for piece in plan:
            self._reduce_scatter(
                flat, piece, send[: self.world * piece.numel].view(self.world, piece.numel), mine[: piece.numel]
            )
        # on a GPU the future records the current stream, which the collectives and the writes ran on
        done: torch.futures.Future = torch.futures.Future(devices=[flat.device] if flat.is_cuda else None)
        done.set_result(flat)
        return done

    def _reduce_scatter(
        self, flat: torch.Tensor, piece: zero1_buckets.Bucket, send: torch.Tensor, mine: torch.Tensor
    ) -> None:
        """One piece of a bucket: every rank's rows packed, reduce-scattered, the mean of this
        rank's rows written back into `flat`."""
        at = 0
        for part in piece.pieces:
            for r in range(self.world):
                a, b = part.slot.span(r, self.world, part.lo, part.hi)
                region = send[r, at : at + part.padded]
                region[: b - a].copy_(flat[a:b])
                region[b - a :].zero_()  # the short last chunk
            at += part.padded
        gloo_comms.reduce_scatter_single(mine, send.view(-1), self.group)  # gloo: an all-to-all and a sum
        at = 0
        for part in piece.pieces:
            a, b = part.slot.span(self.rank, self.world, part.lo, part.hi)
            torch.div(mine[at : at + b - a], self.world, out=flat[a:b])
            at += part.padded

    def norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The global norm of `grads` (the prepared model's): each reduce-scattered gradient counted
        by its owner's rows (combined over the ranks, a scalar once), every other one whole."""
        norm_type = float(norm_type)
        by_grad = {
            id(p.grad): p for p in (ref() for ref in self._sharded.values()) if p is not None and p.grad is not None
        }
        own, whole = [], []
        for g in grads:
            p = by_grad.get(id(g))
            if p is None or not self._scattered.get(id(p), False):
                whole.append(g.detach())
            elif p.dim() > 0 or self.rank == 0:
                slot = _grad_slot(p, 0, self.world)
                a, b = slot.span(self.rank, self.world, 0, slot.rows_per_rank)
                own.append(g.detach().reshape(-1)[a:b])
        device = grads[0].device if grads else torch.device("cpu")
        local = torch.stack(
            [torch.linalg.vector_norm(t, norm_type).float() for t in own] or [torch.zeros((), device=device)]
        )
        if math.isinf(norm_type):
            total = local.max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = local.pow(norm_type).sum()
            dist.all_reduce(total, group=self.group)
        if whole:  # replicated gradients, equal on every rank: counted here alone
            rest = torch.nn.utils.get_total_norm(whole, norm_type).float().to(total.device)
            total = torch.maximum(total, rest) if math.isinf(norm_type) else total + rest.pow(norm_type)
        return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
