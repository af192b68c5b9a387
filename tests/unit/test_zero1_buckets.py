"""zero1's gather buckets: every rank's rows of every parameter travel exactly once, no bucket
receives more than its bytes (a parameter larger than a bucket is cut by rows), and the rows packed
by each rank land where they belong in the full parameter (uneven chunks included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.strategies.optimizers import zero1_buckets
from phalanx.strategies.optimizers.sharded_optimizer import _Slot

SHAPES = [(10, 3), (7,), (), (1, 4), (5, 2, 2)]


def _slots(world_size: int, rank: int, fill: float | None = None) -> list[_Slot]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    if fill is not None:
        for p in params:
            p.data.fill_(fill)
    return [_Slot(p, world_size, rank) for p in params]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("numel", [1, 5, 12, 1000])
def test_pieces_cover_every_row_once_within_the_bucket_size(world_size, numel):
    slots = _slots(world_size, 0)
    buckets = zero1_buckets.plan_buckets(slots, numel)
    for bucket in buckets:
        widest_row = max(p.slot.row_numel for p in bucket.pieces)
        assert bucket.numel <= max(numel, widest_row)  # a row wider than a bucket goes alone
        assert bucket.numel == sum(p.padded for p in bucket.pieces)
    for slot in slots:
        rows = [r for b in buckets for p in b.pieces if p.slot is slot for r in range(p.lo, p.hi)]
        assert rows == list(range(slot.rows_per_rank))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("numel", [1, 5, 1000])
@torch.no_grad()  # as the optimizer's step gathers
def test_packed_rows_land_in_the_full_parameters(world_size, numel):
    # each rank's slots see the same parameters; rank r packs its rows, "gathered" by stacking
    expected = [s.full.clone() for s in _slots(world_size, 0)]
    ranks = [_slots(world_size, r) for r in range(world_size)]
    plans = [zero1_buckets.plan_buckets(slots, numel) for slots in ranks]
    for me in range(world_size):
        receiver = _slots(world_size, me, fill=-1.0)  # stale, but for its own rows: stepped in place
        for slot, want in zip(receiver, expected):
            if not slot.replicated:
                slot.full[slot.start : slot.end] = want[slot.start : slot.end]
        for b, bucket in enumerate(zero1_buckets.plan_buckets(receiver, numel)):
            table = torch.full((world_size, bucket.numel), float("nan"))
            for r in range(world_size):
                plans[r][b].pack(table[r], world_size, r)
            assert not table.isnan().any()  # a short last chunk sends zeros after its rows
            bucket.unpack(table, world_size, me)
        for slot, want in zip(receiver, expected):
            if slot.replicated:  # every rank steps a scalar itself: not gathered
                continue
            torch.testing.assert_close(slot.full, want, rtol=0, atol=0)


@torch.no_grad()
def test_a_replaced_parameter_storage_makes_the_copies_again():
    world_size = 2
    ranks = [_slots(world_size, r) for r in range(world_size)]
    buckets = [zero1_buckets.plan_buckets(slots, 1000)[0] for slots in ranks]
    table = torch.zeros(world_size, buckets[0].numel)
    for r in range(world_size):
        buckets[r].pack(table[r], world_size, r)
    slot = ranks[1][0]  # rank 1's first parameter, replaced as `param.data = ...` does
    slot.param.data = torch.full_like(slot.param, 7.0)
    slot.follow_param()
    buckets[1].pack(table[1], world_size, 1)
    rows = slot.end - slot.start
    assert torch.equal(table[1, : rows * slot.row_numel], torch.full((rows * slot.row_numel,), 7.0))


def test_bucket_bytes_follow_the_model_within_bounds():
    mib = 2**20
    assert zero1_buckets.bucket_bytes(1000) == zero1_buckets.GATHER_MIN_BUCKET_BYTES
    assert zero1_buckets.bucket_bytes(32 * mib) == 2 * mib
    assert zero1_buckets.bucket_bytes(28 * 2**30) == zero1_buckets.GATHER_BUCKET_BYTES
