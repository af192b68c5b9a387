"""Embedding tables under zero2/zero3, looked up where their rows live.

FSDP2 gathers a table whole for every forward and reduces its whole gradient in backward: 2 x V x D
values a step, although a batch touches only its own tokens. Here each rank keeps its rows (a
Shard(0) DTensor, as FSDP2 would) and each forward exchanges whichever is smaller, decided alike on
every rank from the batch sizes:
- the looked-up rows (world x tokens < V): every rank's token ids are gathered, each rank looks up
  the rows it holds for all of them, and one reduce-scatter of world x tokens x D values hands every
  rank its batch's embeddings (each row is held by one rank, the others add zeros: the sum is exact
  in any order); backward all-gathers the output gradients and each rank adds them into its own
  rows;
- the table: all-gathered and looked up as usual; backward all-reduces the table's gradient and
  keeps this rank's rows.
Either way a rank's gradient is its rows' gradient averaged over ranks, as FSDP2 gives it.

On gloo the gathers and the reduce-scatter go point to point (host_only/gloo_comms.py).

Applies to plain `nn.Embedding` modules outside every sharding unit (the root's, where embeddings
sit) whose weight is not shared with another module and which use none of max_norm, sparse or
scale_grad_by_freq; on a 1-D mesh without CPU offload. The rest stays with FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx.host_only import gloo_comms
from phalanx.strategies.optimizers.sharded_optimizer import dim0_chunk


@dataclass(frozen=True)
class RowLayout:
    """Which rows of a V-row table this rank holds (torch.chunk's split, as DTensor's Shard(0))."""

    num_rows: int
    rank: int
    world_size: int

    @property
    def chunk(self) -> int:
        return -(-self.num_rows // self.world_size)

    @property
    def start(self) -> int:
        return dim0_chunk(self.num_rows, self.world_size, self.rank)[0]

    @property
    def stop(self) -> int:
        return dim0_chunk(self.num_rows, self.world_size, self.rank)[1]


def eligible(model: nn.Module, units: list[nn.Module]) -> list[nn.Embedding]:
    """The model's embeddings this module can take over (see the module docstring)."""
    in_units = {id(m) for unit in units for m in unit.modules()}
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [
        m
        for m in model.modules()
        if type(m) is nn.Embedding
        and id(m) not in in_units
        and uses.get(id(m.weight), 0) == 1
        and m.max_norm is None
        and not m.sparse
        and not m.scale_grad_by_freq
    ]


def shard(embedding: nn.Embedding, mesh: Any, device: torch.device) -> None:
    """Keep this rank's rows of `embedding`'s table on `device` (a meta table stays meta, to be
    initialised like the others) and look tokens up with the exchange above."""
    from torch.distributed.tensor import DTensor, Shard

    full = embedding.weight
    group = mesh.get_group()
    layout = RowLayout(full.shape[0], dist.get_rank(group), dist.get_world_size(group))
    local = full.detach()[layout.start : layout.stop]
    local = local if local.is_meta else local.to(device).clone()
    weight = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    embedding.weight = nn.Parameter(weight, requires_grad=full.requires_grad)
    embedding.phalanx_rows = (layout, group)
    embedding.__class__ = ShardedLookupEmbedding


class ShardedLookupEmbedding(nn.Embedding):
    """An nn.Embedding whose table is sharded by rows over ranks (made by `shard`, never directly).
    `phalanx_exchange` says what the last forward exchanged: 'rows' or 'table'."""

    phalanx_rows: tuple[RowLayout, Any]
    phalanx_exchange: str | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Embedding's name
        layout, group = self.phalanx_rows
        tokens = input.reshape(-1)
        # Count, lowest and highest id, gathered on the device and read back once (one sync per forward).
        ends = torch.stack([tokens.min(), tokens.max()]) if tokens.numel() else tokens.new_zeros(2)
        mine = torch.cat([ends.new_tensor([tokens.numel()]), ends])
        sizes = _all_gather(mine, group, layout.world_size).tolist()
        _check_range(sizes, layout.num_rows)  # on every rank alike: all raise, none waits
        counts = [count for count, _, _ in sizes]
        # Values each way (world x tokens x D, or V x D, in both passes): the same choice on every rank.
        self.phalanx_exchange = "rows" if layout.world_size * max(counts) < layout.num_rows else "table"
        out = _Lookup.apply(
            tokens, self.weight.to_local(), layout, group, self.padding_idx, counts, self.phalanx_exchange
        )
        return out.view(*input.shape, self.embedding_dim)


def _all_gather(tensor: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """(world, *tensor.shape): every rank's `tensor` (same shape everywhere)."""
    out = torch.empty((world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    gloo_comms.all_gather_single(out, tensor.contiguous(), group)
    return out.view(world, *tensor.shape)


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tokens: torch.Tensor,
        local: torch.Tensor,
        layout: RowLayout,
        group: Any,
        padding_idx: int | None,
        counts: list[int],
        exchange: str,
    ) -> torch.Tensor:
        world, most = layout.world_size, max(counts)
        ctx.layout, ctx.group, ctx.padding_idx, ctx.most, ctx.mode = layout, group, padding_idx, most, exchange
        if exchange == "rows":
            every = _all_gather(_padded(tokens, most), group, world)  # (world, most)
            real = torch.arange(most, device=tokens.device) < torch.tensor(counts, device=tokens.device)[:, None]
            rows = every - layout.start
            mine = real & (rows >= 0) & (rows < local.shape[0])
            if padding_idx is not None:
                mine &= every != padding_idx  # its row gets no gradient, as in F.embedding
            rows = torch.where(mine, rows, 0)
            found = F.embedding(rows, local) if local.shape[0] else local.new_zeros((*rows.shape, local.shape[1]))
            found = found * mine.unsqueeze(-1).to(found.dtype)
            if padding_idx is not None and layout.start <= padding_idx < layout.stop:
                found[every == padding_idx] = local[padding_idx - layout.start]  # looked up, never trained
            own = found.new_empty(found.shape[1:])  # the sums of this rank's tokens' rows over the holders
            gloo_comms.reduce_scatter_single(own, found, group)
            ctx.save_for_backward(rows, mine)
            return own[: tokens.numel()]
        table = _all_gather(_padded(local, layout.chunk), group, world).flatten(0, 1)[: layout.num_rows]
        ctx.save_for_backward(tokens)
        return F.embedding(tokens, table, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        layout, group, world = ctx.layout, ctx.group, ctx.layout.world_size
        grad = grad.contiguous()
        rows_held = layout.stop - layout.start
        if ctx.mode == "rows":
            rows, mine = ctx.saved_tensors
            every = _all_gather(_padded(grad, ctx.most), group, world)  # (world, most, D)
            local_grad = grad.new_zeros((rows_held, grad.shape[-1]))
            local_grad.index_add_(0, rows[mine], every[mine])
        else:
            (tokens,) = ctx.saved_tensors
            keep = tokens != ctx.padding_idx if ctx.padding_idx is not None else slice(None)
            table_grad = grad.new_zeros((world * layout.chunk, grad.shape[-1]))
            table_grad.index_add_(0, tokens[keep], grad[keep])
            dist.all_reduce(table_grad, group=group)
            local_grad = table_grad[layout.start : layout.stop].clone()
        return None, local_grad.div_(world), None, None, None, None, None


def _check_range(sizes: list[list[int]], num_rows: int) -> None:
    """Raise as F.embedding would for ids outside the table, naming the ranks that passed them."""
    bad = [
        (rank, low, high) for rank, (count, low, high) in enumerate(sizes) if count and (low < 0 or high >= num_rows)
    ]
    if bad:
        where = "; ".join(f"rank {rank}: {low}..{high}" for rank, low, high in bad)
        raise IndexError(
            f"index out of range in self: token ids must lie in [0, {num_rows}) for this embedding, got {where}"
        )
