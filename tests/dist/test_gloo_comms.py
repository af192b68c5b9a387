"""zero2/zero3's collectives on gloo give what gloo's own give, on 2 and 4 ranks and on a subgroup: the
gradient reduce-scatter (an all-to-all and a local sum) for SUM and AVG, and the parameter all-gather
(each rank's chunk sent point to point into the output) bit for bit, its input a chunk of the output as FSDP2 hands it or
a tensor apart."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def compare_with_gloos_own() -> list[tuple[str, bool, float]]:
    """(case, bit-equal, largest difference) for each op, on the world and on a group of the even ranks."""
    from phalanx.host_only.gloo_comms import AllToAllReduceScatter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group(list(range(0, world, 2)))
    comm, results = AllToAllReduceScatter(), []
    for group, name in ((None, "world"), (evens, "evens")):
        if group is evens and rank % 2:
            continue
        size = dist.get_world_size(group)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            g = torch.Generator().manual_seed(rank)
            grads = torch.randn(size * 1000 + size * 3, generator=g)  # FSDP2 pads to a multiple of the group
            expected, got = torch.empty(grads.numel() // size), torch.full((grads.numel() // size,), float("nan"))
            dist.reduce_scatter_tensor(expected, grads.clone(), op=op, group=group)
            before = grads.clone()
            assert comm(got, grads, group, op) is None
            assert torch.equal(grads, before)  # the input is read, not reduced in place
            results.append((f"{name} {op}", torch.equal(got, expected), (got - expected).abs().max().item()))
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_all_to_all_reduce_scatter_equals_gloos_own(world_size):
    for rank, results in enumerate(
        run_ranks("tests.dist.test_gloo_comms:compare_with_gloos_own", world_size, timeout=90)
    ):
        assert len(results) == (4 if rank % 2 == 0 else 2), results
        for case, equal, largest in results:
            if world_size == 2 or case.startswith("evens"):  # two summands: a + b in either order
                assert equal, (rank, case, largest)
            else:  # four summands, added in another order
                assert largest < 1e-5, (rank, case, largest)


def gather_like_gloos_own() -> list[tuple[str, bool]]:
    """(case, bit-equal to all_gather_into_tensor) on the world and on the odd ranks (a group whose
    ranks are not the global ones), with the input inside the output or apart from it."""
    from phalanx.host_only.gloo_comms import PeerAllGather

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    odds = dist.new_group(list(range(1, world, 2)))
    comm, results = PeerAllGather(), []
    for group, name in ((None, "world"), (odds, "odds")):
        if group is odds and rank % 2 == 0:
            continue
        size, me = dist.get_world_size(group), dist.get_rank(group)
        shard = torch.randn(1003, generator=torch.Generator().manual_seed(rank))
        expected = torch.empty(size * shard.numel())
        dist.all_gather_into_tensor(expected, shard, group=group)
        inside = torch.full_like(expected, float("nan"))
        mine = inside.narrow(0, me * shard.numel(), shard.numel())
        mine.copy_(shard)
        apart = torch.full_like(expected, float("nan"))
        assert comm(inside, mine, group) is None and comm(apart, shard.clone(), group) is None
        results += [(f"{name} inside", torch.equal(inside, expected)), (f"{name} apart", torch.equal(apart, expected))]
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_broadcast_all_gather_equals_gloos_own(world_size):
    for rank, results in enumerate(
        run_ranks("tests.dist.test_gloo_comms:gather_like_gloos_own", world_size, timeout=90)
    ):
        assert len(results) == (4 if rank % 2 else 2), results
        assert all(equal for _, equal in results), (rank, results)


def train_with_step_buffers() -> dict[str, object]:
    """zero3 through phalanx on a model of identical blocks, 3 AdamW steps, with the collectives'
    buffers reused within a step and (the same seed) allocated per use: each run's parameters after
    it, and the reuse counters and buffers kept after each step."""
    from torch import nn

    from phalanx import Phalanx
    from phalanx.host_only import step_buffers

    made: list[step_buffers.StepBuffers] = []
    init = step_buffers.StepBuffers.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    step_buffers.StepBuffers.__init__ = record
    out: dict[str, object] = {}
    for name in ("reused", "per use"):
        if name == "per use":
            step_buffers._use_count = None  # what a torch without the count gets: plain allocations
        px = Phalanx(strategy="zero3", seed=0, watchdog_timeout=0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(96, 96), nn.ReLU()) for _ in range(4)), nn.Linear(96, 4))
        model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(px.rank)
        kept = []
        for _ in range(3):
            optimizer.zero_grad()
            px.backward(model(torch.randn(8, 96, generator=g)).pow(2).mean())
            optimizer.step()
            kept.append(len(made[-1]))
        out[name] = {
            "params": [p.full_tensor() for p in model.parameters()],
            "kept": kept,
            "fresh": made[-1].fresh,
            "reused": made[-1].reused,
            "pools": len(made),
        }
    dist.destroy_process_group()
    return out


def test_zero3_reuses_its_collectives_buffers_within_a_step_and_keeps_none_after_it():
    for rank, out in enumerate(run_ranks("tests.dist.test_gloo_comms:train_with_step_buffers", 2, timeout=90)):
        reused, per_use = out["reused"], out["per use"]
        assert reused["pools"] == 1 and per_use["pools"] == 2  # one pool per prepared model
        assert all(torch.equal(a, b) for a, b in zip(reused["params"], per_use["params"])), rank
        assert reused["kept"] == [0, 0, 0], (rank, reused)  # dropped when each backward ended
        # each step: 4 identical blocks (gathered for the forward and, but the last, the backward;
        # each reduced through an input, the all-to-all's copies and the output, which becomes the
        # sharded gradient) and a smaller last unit. Within a step the blocks hand their buffers on
        # (at least 4 of the 23 takes a step)
        assert reused["reused"] >= 3 * 4 and reused["fresh"] + reused["reused"] == 3 * 23, (rank, reused)
        assert (per_use["fresh"], per_use["reused"]) == (0, 0), (rank, per_use)


def single_ops_like_torchs(engaged: bool) -> list[tuple[str, bool]]:
    """gloo_comms.all_gather_single and reduce_scatter_single against torch's own, on the shapes
    their callers pass (a flat buffer, and the sharded embedding's (world, tokens, D) lookups), with
    the point-to-point path engaged (gloo) or not (what NCCL takes: torch's op, here run on gloo)."""
    from phalanx.host_only import gloo_comms

    dist.init_process_group("gloo")
    gloo_comms.engages = lambda backend: engaged  # the module's own name: what its functions ask
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    results = []
    for shape in ((world * 6,), (world, 5, 3)):
        full = torch.randn(shape, generator=g)
        expected = torch.empty(full.shape[0] // world if len(shape) == 1 else shape[1:])
        dist.reduce_scatter_tensor(expected.view(-1), full.clone().view(-1))
        got = torch.full_like(expected, float("nan"))
        gloo_comms.reduce_scatter_single(got, full, None)
        results.append((f"reduce-scatter {shape}", torch.allclose(got, expected, rtol=0, atol=1e-6)))
        mine = torch.randn(expected.shape, generator=g)
        gathered, want = torch.full_like(full, float("nan")), torch.empty_like(full)
        dist.all_gather_into_tensor(want.view(-1), mine.view(-1))
        gloo_comms.all_gather_single(gathered, mine, None)
        results.append((f"all-gather {shape}", torch.equal(gathered, want)))
    dist.destroy_process_group()
    return results


@pytest.mark.parametrize("engaged", [True, False])
def test_the_single_ops_equal_torchs_with_and_without_the_host_only_path(engaged):
    for rank, results in enumerate(
        run_ranks("tests.dist.test_gloo_comms:single_ops_like_torchs", 2, args=(engaged,), timeout=90)
    ):
        assert len(results) == 4 and all(ok for _, ok in results), (rank, results)
