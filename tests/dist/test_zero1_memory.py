"""zero1 keeps no copy of the parameters: its chunks are views of their rows, gathered through
transient buckets by default (or one persistent buffer, counted by memory_report and the plan);
both equal one process, and a checkpoint loaded into zero1 is what the next step starts from."""

from __future__ import annotations

import pytest
import torch

from phalanx.model import memory
from tests.dist import strategy_workloads as w
from tests.dist import zero1_workloads
from tests.dist.harness import run_ranks
from tests.plan_reference import by_preset

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("zero1-ckpt")
    return run_ranks(
        "tests.dist.harness_calls:calls",
        2,
        timeout=280,
        args=(
            [
                ("tests.dist.zero1_workloads:gathers", ()),
                ("tests.dist.zero1_workloads:load_then_step", (str(checkpoints),)),
            ],
        ),
    )


@pytest.mark.parametrize("case", ["tiny buckets", "persistent", "direct", "scattered, clipped"])
def test_every_gather_and_reduce_scatter_equals_one_process(runs, case):
    clipped = case == "scattered, clipped"
    ref = w.train(clip=zero1_workloads.CLIP) if clipped else w.train()
    for rank, (gathered, _) in enumerate(runs):
        torch.testing.assert_close(
            torch.tensor(gathered[case]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6
        )
        if clipped:  # the norm torch's clip_grad_norm_ gives: the owners' rows combined over the ranks
            torch.testing.assert_close(
                torch.tensor(gathered[case]["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=1e-6
            )
        for name, value in ref["state"].items():  # full weights on every rank
            torch.testing.assert_close(
                gathered[case]["state"][name],
                value,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, rank=rank, name=name: f"rank {rank} {case} {name}: {m}",
            )


def test_chunks_are_views_of_the_parameters_and_buckets_hold_nothing_between_steps(runs):
    for gathered, _ in runs:
        tiny, bucketed = gathered["tiny buckets held"], gathered["bucketed held"]
        assert tiny["chunks_share_params"] and bucketed["chunks_share_params"]
        assert tiny["buckets"] > 5 and bucketed["buckets"] == 1  # 256-byte buckets vs one of at least 1 MiB
        assert tiny["buffer_bytes"] == bucketed["buffer_bytes"] == 0
        assert gathered["bucketed report"]["buffers"] == 0


def test_the_persistent_buffer_is_counted_by_memory_report_and_the_plan(runs):
    model = w.make_model()
    planned = by_preset(memory.model_sizes(model), 2)
    for rank, (gathered, _) in enumerate(runs):
        held = gathered["persistent held"]
        assert held["chunks_share_params"]
        assert held["buffer_bytes"] == held["padded_numel"] * 4 * 2  # 2 ranks' chunks, fp32 (sent in place)
        report = gathered["persistent report"]
        assert report["buffers"] == held["buffer_bytes"]
        assert planned["zero1-persistent"][rank].buffers == held["buffer_bytes"]
        assert planned["zero1"][rank].buffers == 0
        assert planned["zero1-persistent"][rank].total == planned["zero1"][rank].total + held["buffer_bytes"]


@pytest.mark.parametrize("saved_by", ["zero1", "ddp"])
def test_a_checkpoint_loaded_into_zero1_is_what_its_next_step_starts_from(runs, saved_by):
    # before: zero1 stepped its own copy of the chunks, which loading never refreshed, so the first
    # step after a resume put back the fresh run's initial weights plus one update
    for rank, (_, loaded) in enumerate(runs):
        case = loaded[saved_by]
        for name, value in case["expected"].items():
            torch.testing.assert_close(
                case["resumed"][name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}",
            )
