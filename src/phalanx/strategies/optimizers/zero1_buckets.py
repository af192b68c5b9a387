"""How zero1's updated chunks travel: cut into buckets of at most a few MiB, gathered in place.

Each rank owns the same dim-0 chunk of every parameter (torch.chunk's split). A bucket holds
pieces: a range of rows of every rank's chunk of one parameter. A parameter larger than a bucket
is cut into several pieces, so no all-gather receives more than the bucket's bytes, however large
the embedding. A rank packs its rows into its own slot of the receive buffer (an in-place
all-gather: no send buffer), and the gathered rows are copied into each parameter rank by rank
(no gathered copy of a whole parameter on the way).

gloo gathers into a flat buffer of its own and copies that out, so a bucket costs twice its bytes
while it is gathered. Measured on bench/memory.py's Llama (31.6 MB of fp32 parameters, 2 CPU
processes): with one 16 MiB bucket plus a send buffer and a reshaped copy, zero1's step peaked at
39 MiB above its at-rest memory, above ddp's peak; with buckets of 1/16 of the model, at ~5 MiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.host_only import gloo_comms

GATHER_BUCKET_BYTES = 64 * 2**20
"""bucketed: the most bytes one all-gather receives (large models)."""
GATHER_MIN_BUCKET_BYTES = 2**20
"""bucketed: buckets are 1/16 of the parameters' bytes, but no smaller than this (fewer collectives)."""
MODEL_FRACTION = 16
DIRECT_NUMEL = 2**16
"""gloo, bucketed: a parameter of this many elements or more is gathered straight into its rows (each
rank's rows sent to every peer), without a bucket: on CPU, packing a bucket and unpacking it cost as much as the
collective (4.2M fp32 parameters on 2 gloo ranks: 12 ms of a 26 ms gather)."""


def dim0_chunk(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) rows of `rank`'s chunk when `rows` are split as torch.chunk does."""
    per = math.ceil(rows / world_size) if rows else 0
    start = min(rows, rank * per)
    return start, min(rows, start + per)


def bucket_bytes(model_bytes: int) -> int:
    """The bytes one bucketed all-gather receives for a model of `model_bytes` parameters: 1/16
    of them, within [GATHER_MIN_BUCKET_BYTES, GATHER_BUCKET_BYTES] (the first caps it too)."""
    return min(GATHER_BUCKET_BYTES, max(GATHER_MIN_BUCKET_BYTES, model_bytes // MODEL_FRACTION))


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of every rank's chunk of one parameter (a short last chunk sends zeros)."""

    slot: Any  # sharded_optimizer._Slot: full, chunk, replicated, row_numel, rows_per_rank
    lo: int
    hi: int

    @property
    def padded(self) -> int:
        return (self.hi - self.lo) * self.slot.row_numel

    def mine(self) -> torch.Tensor:
        """This rank's rows of the piece, flat (a view of the parameter: rows are contiguous); shorter
        than `padded` where this rank's chunk is the short last one."""
        chunk = self.slot.chunk
        return (chunk if self.slot.replicated else chunk[self.lo : self.hi]).reshape(-1)

    def theirs(self, world_size: int, rank: int) -> torch.Tensor | None:
        """Rank `rank`'s rows of the piece in the full parameter, flat (None: it has none here, or
        the parameter is a scalar every rank stepped itself)."""
        full = self.slot.full
        if self.slot.replicated:
            return None
        start, end = dim0_chunk(full.shape[0], world_size, rank)
        a, b = start + self.lo, min(start + self.hi, end)
        return full[a:b].view(-1) if b > a else None


@dataclass
class _Copies:
    """A bucket's copies between the parameters and its buffer, made once per parameter storage:
    one foreach copy packs this rank's rows, one per peer unpacks its rows (on a GPU, a launch each
    instead of one per piece and rank; on CPU the guard encoder's 34 small parameters, 2.7 -> 1.2 ms)."""

    key: tuple[int, ...]  # the parameters' storage: a `param.data = ...` makes them again
    sizes: list[int]  # each piece's padded elements in a rank's slot of the buffer
    mine: list[torch.Tensor]  # this rank's rows of each piece
    theirs: list[list[tuple[int, torch.Tensor]]]  # per rank: (piece, that rank's rows in the parameter)


@dataclass
class Bucket:
    pieces: list[Piece]
    numel: int  # per rank
    _copies: _Copies | None = field(default=None, repr=False, compare=False)

    def copies(self, world_size: int, rank: int) -> _Copies:
        key = tuple(piece.slot.full.data_ptr() for piece in self.pieces)
        if self._copies is None or self._copies.key != key:
            theirs = [
                [(i, rows) for i, piece in enumerate(self.pieces) if (rows := piece.theirs(world_size, r)) is not None]
                for r in range(world_size)
            ]
            self._copies = _Copies(key, [p.padded for p in self.pieces], [p.mine() for p in self.pieces], theirs)
        return self._copies

    def pack(self, send: torch.Tensor, world_size: int, rank: int) -> None:
        """This rank's rows of every piece into `send` (its slot of the buffer); zeros after a short chunk."""
        copies = self.copies(world_size, rank)
        parts = send.split(copies.sizes)
        torch._foreach_copy_([part[: rows.numel()] for part, rows in zip(parts, copies.mine)], copies.mine)
        for part, rows in zip(parts, copies.mine):
            if rows.numel() < part.numel():  # the short last chunk
                part[rows.numel() :].zero_()

    def unpack(self, table: torch.Tensor, world_size: int, rank: int) -> None:
        """Every peer's rows (`table`: world_size x numel) into the parameters; this rank's are there."""
        copies = self.copies(world_size, rank)
        for r in range(world_size):
            if r == rank or not copies.theirs[r]:
                continue
            parts = table[r].split(copies.sizes)
            torch._foreach_copy_(
                [rows for _, rows in copies.theirs[r]], [parts[i][: rows.numel()] for i, rows in copies.theirs[r]]
            )


def plan_buckets(slots: list[Any], numel: int) -> list[Bucket]:
    """Consecutive slots' rows in buckets of at most `numel` elements per rank; a parameter larger
    than that is cut by rows (a single row larger than a bucket goes alone)."""
    out: list[Bucket] = []
    current = Bucket([], 0)
    for slot in slots:
        lo = 0
        while lo < slot.rows_per_rank:
            room = (numel - current.numel) // slot.row_numel
            if room < 1 and current.pieces:
                out.append(current)
                current = Bucket([], 0)
                room = numel // slot.row_numel
            hi = min(slot.rows_per_rank, lo + max(1, room))
            piece = Piece(slot, lo, hi)
            current.pieces.append(piece)
            current.numel += piece.padded
            lo = hi
    if current.pieces:
        out.append(current)
    return out


def gathered_directly(slots: list[Any], world_size: int, gloo: bool) -> list[Any]:
    """The slots gathered straight into their parameters' rows (gloo, large, contiguous)."""
    return [
        s
        for s in slots
        if gloo and not s.replicated and s.padded * world_size >= DIRECT_NUMEL and s.full.is_contiguous()
    ]


def gather_directly(slots: list[Any], world_size: int, group: Any) -> None:
    """Every rank's rows of each slot's parameter sent by that rank straight into them on every peer."""
    parts = []
    for slot in slots:
        for r in range(world_size):
            start, end = dim0_chunk(slot.full.shape[0], world_size, r)
            if end > start:
                parts.append((slot.full[start:end], r))
    gloo_comms.exchange(parts, group)


def gather(
    buckets: list[Bucket],
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    group: Any,
    persistent: torch.Tensor | None = None,
) -> None:
    """One in-place all-gather per bucket: this rank's rows out, every rank's rows into the
    parameters. `persistent`: one buffer for the single bucket, kept by the caller. On gloo each
    rank's rows go straight into its place in every peer's buffer (gloo_comms: no buffer of gloo's own)."""
    for bucket in buckets:
        received = (
            persistent if persistent is not None else torch.empty(bucket.numel * world_size, dtype=dtype, device=device)
        )
        table = received.view(world_size, bucket.numel)
        send = table[rank]
        bucket.pack(send, world_size, rank)
        gloo_comms.all_gather_single(received, send, group)  # on gloo: each rank's rows sent into place
        bucket.unpack(table, world_size, rank)
        del send, received, table  # a bucket's buffer goes before the next one's is made
