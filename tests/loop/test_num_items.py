"""`px.backward(loss, num_items=n)`: 2 ranks x 2 micro-steps of variable-length padded sequences equal
one process on the whole global batch (loss = Σ CE / Σ target tokens), under every strategy, with
clipping after the rescale and fp16's scaler; the per-micro-batch mean does not."""

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.loop import num_items_workloads as w

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

CASES = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "hsdp": {"strategy": "hsdp"},  # 2 "nodes" x 1 process: replicas whose gradients FSDP2 all-reduces
    "ddp_fp16": {"strategy": "ddp", "mixed_precision": "fp16"},
    "zero3_fp16": {"strategy": "zero3", "mixed_precision": "fp16"},
    "ddp_mean": {"strategy": "ddp", "weighting": "mean"},
    "zero3 unclipped": {"strategy": "zero3", "clip": False},  # the rescale alone, no clip_grad_norm_ after it
}


@pytest.fixture(scope="module")
def runs() -> dict:
    ranks = run_ranks(
        "tests.dist.harness_calls:calls",
        2,
        local_world_size=1,
        timeout=360,
        args=(
            [
                ("tests.loop.num_items_workloads:matrix", (CASES,)),
                ("tests.loop.num_items_workloads:no_items_anywhere", ("rank0",)),
                ("tests.loop.num_items_workloads:no_items_anywhere", ("all",)),
                ("tests.loop.num_items_workloads:bad_num_items", ()),
            ],
        ),
    )
    return {"ranks": ranks, "reference": w.reference(), "skipped_first": w.reference(skip_first=True)}


def _close_state(actual: dict, expected: dict, rtol: float, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("case", [c for c in CASES if c != "ddp_mean" and "fp16" not in c])
def test_num_items_on_two_ranks_and_two_micro_steps_equals_one_process(runs, case):
    ref = runs["reference"]
    for rank, ranks in enumerate(runs["ranks"]):
        result = ranks[0][case]
        assert result["strategy"] == CASES[case]["strategy"] and result["global_step"] == w.STEPS
        # clip_grad_norm_ returned the global batch's gradient norm: it ran after the rescale
        if CASES[case].get("clip", True):
            assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5), rank
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-6), rank  # px.step_loss
        if rank == 0 or case in ("ddp", "zero1"):  # sharded: full weights on the main process
            _close_state(result["state"], ref["state"], 1e-5, 1e-6)


@pytest.mark.parametrize("case", ["ddp_fp16", "zero3_fp16"])
def test_num_items_with_fp16_skips_an_overflowing_step_and_keeps_no_count_of_it(runs, case):
    # The initial loss scale (65536) overflows this model's fp16 gradients in step 1 (so it does with a
    # plain mean loss): the scaler skips it; step 2 must average its own items only.
    ref = runs["skipped_first"]
    for rank, ranks in enumerate(runs["ranks"]):
        result = ranks[0][case]
        assert result["global_step"] == 1, rank
        assert result["norms"][1] == pytest.approx(ref["norms"][1], rel=1e-3), rank  # fp16 matmuls on CPU
        if rank == 0 or case == "ddp_fp16":
            _close_state(result["state"], ref["state"], 1e-3, 1e-3)


def test_the_per_micro_batch_mean_does_not_equal_the_global_batch(runs):
    ref = runs["reference"]["state"]
    mean = runs["ranks"][0][0]["ddp_mean"]["state"]
    differs = max((mean[k] - ref[k]).abs().max().item() for k in ref)
    assert differs > 1e-2  # the token-weighted run matches within 1e-6 (above)


def test_zero_items_on_some_ranks_is_fine_on_every_rank_raises_naming_the_step(runs):
    for ranks in runs["ranks"]:
        assert ranks[1] == "ok after 2 steps"
        assert ranks[2].startswith("step 2: num_items summed to 0 over all 2 rank(s) and micro-steps"), ranks[2]


def test_a_bad_num_items_on_one_rank_raises_the_same_error_on_every_rank(runs):
    """Refused on rank 1 alone, the other rank waited in a collective until the watchdog."""
    r0, r1 = (ranks[3] for ranks in runs["ranks"])
    assert r0 == r1
    assert r0["None in the first step"].startswith("px.backward: num_items was given on 1 of 2 data-parallel ranks")
    assert r0["None in a later step"].startswith("step 2: px.backward was called 1 time(s) without num_items")
    assert r0["negative"].startswith("step 2: num_items was negative in 1 backward call(s)")
    assert r0["a string"].startswith("step 1: num_items was not a number or a one-element tensor in 1 backward")
    assert r0["a tensor of 2"].startswith("step 2: num_items was not a number or a one-element tensor")
