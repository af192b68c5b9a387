"""hsdp on 2 "nodes" x 2 processes (4 CPU ranks, LOCAL_WORLD_SIZE=2) equals one process on the same
global batches, and its checkpoint resumes under zero3 on 2 ranks; zero1's balanced optimizer
checkpoint resumes under zero3 and ddp. Two launches in all: the 4-rank one, then the 2-rank one."""

from __future__ import annotations

import pytest
import torch

from phalanx.model import memory
from phalanx.strategies.plan.presets import hybrid_shape
from tests.dist import strategy_workloads as w
from tests.dist.harness import run_ranks
from tests.plan_reference import by_preset, zero1_owners

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def _close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _optim_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys() and len(expected) == 15  # every TinyNet parameter
    for name in expected:
        _close(actual[name], expected[name])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hsdp")
    hsdp_ckpt, zero1_ckpt = str(tmp / "hsdp"), str(tmp / "zero1")
    four = run_ranks(
        "tests.dist.strategy_workloads:matrix",
        4,
        local_world_size=2,
        timeout=300,
        args=(
            {
                "hsdp": {"strategy": "hsdp", "checkpoint": hsdp_ckpt, "full_optimizer": True},
            },
        ),
    )
    two = run_ranks(
        "tests.dist.harness_calls:calls",
        2,
        timeout=300,
        args=(
            [
                (
                    "tests.dist.strategy_workloads:matrix",
                    ({"zero1": {"strategy": "zero1", "checkpoint": zero1_ckpt, "full_optimizer": True}},),
                ),
                ("tests.dist.shard_workloads:one_step_bytes", ()),
            ],
        ),
    )
    resumed = run_ranks(
        "tests.dist.harness_calls:calls",
        2,
        timeout=300,
        args=(
            [
                ("tests.dist.strategy_workloads:resume_under", ("zero3", hsdp_ckpt)),
                ("tests.dist.strategy_workloads:resume_under", ("zero3", zero1_ckpt)),
                ("tests.dist.strategy_workloads:resume_under", ("ddp", zero1_ckpt)),
            ],
        ),
    )
    return {"four": four, "two": two, "resumed": resumed}


def test_hsdp_on_two_nodes_of_two_equals_one_process(runs):
    ref = w.train()
    for rank, result in enumerate(runs["four"]):
        assert result["hsdp"]["strategy"] == "hsdp"
        if rank == 0:  # full weights are gathered on the main process only
            _close(result["hsdp"]["state"], ref["state"])
            torch.testing.assert_close(
                torch.tensor(result["hsdp"]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5
            )
        restored = result["hsdp"]["restored"]
        assert restored["global_step"] == (8, 8) and restored["manifest_strategy"] == "hsdp"
        assert restored["optimizer_equal"], rank


def test_hsdp_holds_half_the_bytes_of_a_replica_within_a_node(runs):
    held = [r["hsdp"]["bytes"] for r in runs["four"]]
    full = sum(p.numel() * 4 for p in w.make_model().parameters())
    for b in held:  # sharded over the node's 2 processes: half, up to uneven dim-0 chunks
        assert 0.45 * full <= b["params"] <= 0.55 * full, b


def test_hsdp_checkpoint_resumes_under_zero3_on_two_ranks(runs):
    saved = runs["four"][0]["hsdp"]
    resumed = [r[0] for r in runs["resumed"]]
    assert resumed[0]["strategy"] == "zero3" and resumed[0]["global_step"] == 8
    _close(resumed[0]["state"], saved["state"])
    for rank in (0, 1):
        _optim_equal(runs["resumed"][rank][0]["optim_full"], saved["optim_full"])


def test_zero1_splits_the_optimizer_state_of_a_dominant_embedding_evenly(runs):
    from tests.dist.shard_workloads import big_embedding_model

    sizes = memory.model_sizes(big_embedding_model())
    ddp = runs["two"][0][1]["ddp"]["bytes"]
    for rank in (0, 1):
        z1 = runs["two"][rank][1]["zero1"]["bytes"]
        # full parameters and gradients, as ddp; half the optimizer state (ZeroRedundancyOptimizer: 0.97)
        assert (z1["params"], z1["grads"]) == (ddp["params"], ddp["grads"])
        assert 0.49 <= z1["optimizer"] / ddp["optimizer"] <= 0.51, z1
        assert z1["optimizer"] == by_preset(sizes, 2)["zero1"][rank].optimizer
    # the embedding is 95% of the model: whole-parameter placement cannot balance it
    owners = zero1_owners(sizes, 2)
    assert sum(s.numel for s, o in zip(sizes, owners) if o == 0) / sum(s.numel for s in sizes) > 0.95
    # and the step is right: the same weights as ddp after one step on the same batches
    _close(runs["two"][0][1]["zero1"]["weights"], runs["two"][0][1]["ddp"]["weights"])


@pytest.mark.parametrize("index,strategy", [(1, "zero3"), (2, "ddp")])
def test_zero1_checkpoint_resumes_under(runs, index, strategy):
    saved = runs["two"][0][0]["zero1"]
    assert saved["restored"]["weights_equal"] and saved["restored"]["optimizer_equal"]
    for rank in (0, 1):
        resumed = runs["resumed"][rank][index]
        assert resumed["strategy"] == strategy and resumed["global_step"] == 8
        _optim_equal(resumed["optim_full"], saved["optim_full"])
    _close(runs["resumed"][0][index]["state"], saved["state"])


def test_mesh_shape_defaults_to_one_replica_per_node_and_names_a_bad_split():
    assert hybrid_shape(8, 4) == (2, 4)
    assert hybrid_shape(8, 4, replicate_size=4) == (4, 2)
    assert hybrid_shape(8, 4, shard_size=8) == (1, 8)
    assert hybrid_shape(4, 4, tp=2) == (2, 2)  # tp takes 2 of each node's 4 processes
    with pytest.raises(ValueError, match=r"replicate_size=3 x shard_size=2 does not cover the 8 data-parallel ranks"):
        hybrid_shape(8, 4, replicate_size=3, shard_size=2)
    with pytest.raises(ValueError, match=r"shard_size=0 must be a positive integer"):
        hybrid_shape(8, 4, shard_size=0)
