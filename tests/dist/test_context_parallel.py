"""A tiny Llama (and Mistral, for the sliding window) trained through px.forward_backward at cp 2
equals one process: per-step loss within 2e-4 relative over 6 steps, for each mask and both
attention algorithms; every mask at cp 2 x dp 2 and at cp 2 x tp 2 on 4 processes (slow). Encoders
(ModernBERT's two-sided window, BERT with padding) and the docs' hand-written loop (px.shard_sequence,
px.backward with num_items) against plain transformers in one process: loss, grad norm, weights."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks

CP2 = {"PHALANX_CP": "2"}


def train(mask: str, world_size: int = 2, env: dict | None = None, **kwargs) -> list[dict]:
    args = (mask, kwargs.pop("global_batch", 4), 6, kwargs.pop("num_items", False), kwargs.pop("model_args", None))
    return run_ranks(
        "tests.dist.cp_workloads:train_llm",
        world_size=world_size,
        args=args,
        timeout=420,
        env={**CP2, "PHALANX_STRATEGY": "ddp", **(env or {})},
    )


def assert_equal_to_one_process(ranks: list[dict], algorithm: str) -> None:
    reference = ranks[0]["reference"]
    for rank in ranks:
        assert rank["cp_size"] == 2 and rank["algorithm"] == algorithm
        for got, want in zip(rank["losses"], reference, strict=True):
            assert abs(got - want) <= 2e-4 * abs(want), (rank["losses"], reference)
    assert sorted(r["cp_rank"] for r in ranks) == sorted([0, 1] * (len(ranks) // 2))


def test_causal_ulysses_cp2() -> None:
    assert_equal_to_one_process(train("causal"), "ulysses")


def test_packed_allgather_cp2_num_items() -> None:
    # one key/value head: Ulysses cannot split it over 2 ranks, so the all-gather runs
    assert_equal_to_one_process(train("packed", num_items=True, model_args={"kv_heads": 1}), "allgather")


def test_packed_with_the_default_cache_cp2() -> None:
    # use_cache defaults to True: transformers then attends across the packed documents, and so must the cut
    assert_equal_to_one_process(train("packed_with_cache"), "ulysses")


@pytest.mark.slow
def test_packed_ulysses_cp2() -> None:
    assert_equal_to_one_process(train("packed"), "ulysses")


@pytest.mark.slow
def test_padding_cp2_num_items() -> None:
    assert_equal_to_one_process(train("padding", num_items=True), "ulysses")


@pytest.mark.slow
def test_sliding_window_cp2() -> None:
    assert_equal_to_one_process(train("causal", model_args={"sliding_window": 5}), "ulysses")


@pytest.mark.slow
def test_zero3_cp2_packed() -> None:
    assert_equal_to_one_process(train("packed", env={"PHALANX_STRATEGY": "zero3"}), "ulysses")


@pytest.fixture(scope="module")
def own_model() -> list[dict]:
    return run_ranks("tests.dist.cp_workloads:train_own_model", world_size=2, timeout=300)


@pytest.mark.parametrize("attend", ["sdpa", "px", "hand"])
def test_own_model_attention_routed(own_model: list[dict], attend: str) -> None:
    for rank in own_model:
        losses, reference = rank[attend]
        for got, want in zip(losses, reference, strict=True):
            assert abs(got - want) <= 2e-4 * abs(want), (losses, reference)


def test_the_cut_ends_with_backward(own_model: list[dict]) -> None:
    import torch

    for rank in own_model:
        got, want = rank["whole_row"]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_attention_that_cannot_be_routed_is_refused(own_model: list[dict]) -> None:
    for rank in own_model:
        assert "mha is an nn.MultiheadAttention" in rank["mha"] and "px.attention(q, k, v)" in rank["mha"]
        assert "no attention of OwnAttentionLM went across the cut" in rank["manual"]
        # an MLP through px.forward_backward: its features cut as a sequence broke its first matmul ("mat1 and
        # mat2 shapes cannot be multiplied (4x4 and 8x16)"), now the same refusal, naming the cut and the way
        assert rank["mlp"].startswith(
            "ValueError: context parallel: no attention of Sequential went across the cut "
            "before its forward failed on the cut batch"
        ), rank["mlp"]
        assert "cp=1" in rank["mlp"]


def test_hand_written_loop_num_items_is_the_batch_count() -> None:
    """docs/long-sequences.md's loop: px.shard_sequence(pad=True), then px.backward(loss, num_items=n)
    with n the batch's target count, equals plain torch in one process (it was 1/cp of it)."""
    import torch

    ranks = run_ranks("tests.dist.cp_workloads:train_hand_loop", world_size=2, timeout=300)
    reference = ranks[0]["reference"]
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=2e-4, atol=0)
        torch.testing.assert_close(rank["norms"], reference["norms"], rtol=2e-4, atol=0)
        torch.testing.assert_close(rank["weights"], reference["weights"], rtol=2e-4, atol=2e-5)  # AdamW: tiny grads


@pytest.mark.parametrize("kind", ["modernbert", "bert"])
def test_encoder_masks_equal_one_process(kind: str) -> None:
    """ModernBERT's sliding window looks both ways (|q - k| <= local_attention / 2; it looked only
    back), BERT's padding masks keys: at cp 2 both train as one process does (loss, grad norm, weights)."""
    import torch

    ranks = run_ranks("tests.dist.cp_workloads:train_encoder", world_size=2, args=(kind,), timeout=300)
    reference = ranks[0]["reference"]
    for rank in ranks:
        torch.testing.assert_close(rank["losses"], reference["losses"], rtol=2e-4, atol=0)
        torch.testing.assert_close(rank["norms"], reference["norms"], rtol=2e-4, atol=0)
        torch.testing.assert_close(rank["weights"], reference["weights"], rtol=2e-4, atol=2e-5)  # AdamW: tiny grads


@pytest.mark.slow
def test_checkpoint_at_cp2_dp2_resumes_at_dp4_and_one_process(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    args = ("packed", 8, 6, False, None)
    saved = run_ranks(
        "tests.dist.cp_workloads:train_llm",
        world_size=4,
        args=(*args, (3, path)),
        timeout=420,
        env={**CP2, "PHALANX_STRATEGY": "zero3"},
    )
    assert_equal_to_one_process(saved, "ulysses")
    after = saved[0]["losses"][3:]
    for world_size, env in ((4, {"PHALANX_CP": "1", "PHALANX_STRATEGY": "ddp"}), (1, {"PHALANX_CP": "1"})):
        resumed = run_ranks(
            "tests.dist.cp_workloads:train_llm", world_size=world_size, args=(*args, None, path), timeout=420, env=env
        )
        for rank in resumed:
            assert len(rank["losses"]) == 3
            for got, want in zip(rank["losses"], after, strict=True):
                assert abs(got - want) <= 2e-4 * abs(want), (rank["losses"], after)


@pytest.mark.slow
def test_zero1_cp2_dp2_causal() -> None:
    ranks = train("causal", world_size=4, global_batch=8, env={"PHALANX_STRATEGY": "zero1"})
    assert_equal_to_one_process(ranks, "ulysses")


@pytest.mark.slow
def test_hsdp_cp2_two_nodes_packed() -> None:
    # 2 "nodes" of 2 processes: a replica per node, parameters sharded over its cp ranks
    ranks = run_ranks(
        "tests.dist.cp_workloads:train_llm",
        world_size=4,
        local_world_size=2,
        timeout=420,
        args=("packed", 8, 6, False, None),
        env={**CP2, "PHALANX_STRATEGY": "hsdp"},
    )
    assert [r["dp_size"] for r in ranks] == [2] * 4
    assert_equal_to_one_process(ranks, "ulysses")


@pytest.mark.slow
def test_cp2_tp2_causal_mean_loss() -> None:
    # the mean loss (no num_items) at tp 2; the all-gather runs (one key/value head per tp rank)
    ranks = train("causal", world_size=4, env={"PHALANX_TP": "2"})
    assert_equal_to_one_process(ranks, "allgather")


# ---- every mask at cp 2 x dp 2 and cp 2 x tp 2: one 4-process launch per layout trains all four ----
# layout: (env, global batch, dp size, algorithm); tp 2 leaves each rank one of the two key/value
# heads, so the all-gather runs there
LAYOUTS = {
    "cp2_dp2": ({"PHALANX_STRATEGY": "ddp"}, 8, 2, "ulysses"),
    "cp2_tp2": ({"PHALANX_STRATEGY": "ddp", "PHALANX_TP": "2"}, 4, 1, "allgather"),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_run(request) -> tuple[str, list[dict]]:
    """Each rank's result of train_llm_masks at one layout, launched once for the module."""
    env, global_batch, _, _ = LAYOUTS[request.param]
    return request.param, run_ranks(
        "tests.dist.cp_workloads:train_llm_masks", world_size=4, timeout=840, args=(global_batch, 6), env={**CP2, **env}
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mask", ["causal", "packed", "window", "padding"])
def test_every_mask_at_4_processes(layout_run: tuple[str, list[dict]], mask: str) -> None:
    layout, ranks = layout_run
    _, _, dp_size, algorithm = LAYOUTS[layout]
    assert [r["dp_size"] for r in ranks] == [dp_size] * 4
    reference = ranks[0][mask]["reference"]
    assert len(reference) == 6
    assert_equal_to_one_process([{**r, **r[mask], "reference": reference} for r in ranks], algorithm)
