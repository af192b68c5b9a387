"""Tensor parallel, alone and composed with the data-parallel presets, equal to one process on the
same global batches (AdamW, through px.forward_backward); checkpoints moving between layouts."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.tp_workloads import TINY_LM_PLAN

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

TWO_RANKS = {
    "llama tp2": {"kind": "llama", "strategy": "ddp", "tp": 2},
    # transformers reads positions (rotary cos/sin) and the mask from the embedded sequence: it stays
    # whole, and the first decoder layer splits it (was cut at the embedding: a crash in attention)
    "llama tp2 + sequence parallel": {"kind": "llama", "strategy": "zero3", "tp": 2, "sequence_parallel": True},
    "user plan tp2": {"kind": "tinylm", "strategy": "ddp", "tp": 2, "tp_plan": TINY_LM_PLAN},
    "user plan tp2 + sequence parallel": {
        "kind": "tinylm",
        "strategy": "zero3",
        "tp": 2,
        "tp_plan": TINY_LM_PLAN,
        "sequence_parallel": True,
    },
}


def _four_ranks(checkpoint: str) -> dict[str, dict]:
    return {
        "llama zero3 x tp2": {"kind": "llama", "strategy": "zero3", "tp": 2, "checkpoint": checkpoint},
        "user plan zero1 x tp2": {"kind": "tinylm", "strategy": "zero1", "tp": 2, "tp_plan": TINY_LM_PLAN},
        "user plan ddp x tp2": {"kind": "tinylm", "strategy": "ddp", "tp": 2, "tp_plan": TINY_LM_PLAN},
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks("tests.dist.tp_workloads:matrix", 2, args=(TWO_RANKS,), timeout=400)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    checkpoint = str(tmp_path_factory.mktemp("tp") / "zero3-tp2")
    ranks = run_ranks("tests.dist.tp_workloads:matrix", 4, args=(_four_ranks(checkpoint),), timeout=500)
    resumed = run_ranks(
        "tests.dist.tp_workloads:train",
        2,
        args=("llama", 8, 3, 1e-2, None, checkpoint),
        timeout=300,
        env={"PHALANX_STRATEGY": "ddp"},
    )
    return ranks, resumed


def _assert_equal_to_reference(ranks: list[dict], name: str) -> None:
    ref = ranks[0][name]["reference"]
    for rank in ranks:
        run = rank[name]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
        assert run["state"].keys() == ref["state"].keys() or not run["state"]  # sharded: main process only
    state = ranks[0][name]["state"]
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():  # AdamW's normalised steps amplify rounding on tiny gradients
        torch.testing.assert_close(state[key], value.float(), rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_tensor_parallel_on_two_ranks_equals_one_process(two, name):
    _assert_equal_to_reference(two, name)
    assert [r[name]["dp"] for r in two] == [(0, 1), (0, 1)]  # one tensor-parallel group: the same data
    assert torch.equal(two[0][name]["seen"][0], two[1][name]["seen"][0])
    assert two[0][name]["dtensors"], "no parameter was split"
    ref = two[0][name]["reference"]["state"]
    for rank, run in enumerate(two):  # every rank's own part, against that part of one process's weights
        for key, (placements, local) in run[name]["local"].items():
            assert len(placements) == 1 and placements[0].startswith(("Shard(dim=", "Replicate")), (key, placements)
            part = (
                ref[key].float()
                if placements[0].startswith("Replicate")
                else torch.chunk(ref[key].float(), 2, dim=int(placements[0][len("Shard(dim=") : -1]))[rank]
            )
            torch.testing.assert_close(local, part, rtol=1e-4, atol=1e-4, msg=f"rank {rank}: {key}")


def test_llama_uses_its_own_transformers_plan(two):
    split = two[0]["llama tp2"]["dtensors"]
    assert "model.layers.0.self_attn.q_proj.weight" in split and "model.layers.1.mlp.down_proj.weight" in split
    assert "lm_head.weight" in split and "model.embed_tokens.weight" in split  # embedding_rowwise
    # not in the plan: replicated, as a Replicate() DTensor like every other parameter (torch's
    # clip_grad_norm_ and foreach optimizers see one kind of tensor)
    assert split == two[0]["llama tp2"]["params"]
    assert two[0]["llama tp2"]["placements"]["model.norm.weight"] == ["Replicate"]
    assert two[0]["llama tp2"]["placements"]["model.layers.0.self_attn.q_proj.weight"] == ["Shard"]


@pytest.mark.parametrize("name", ["llama zero3 x tp2", "user plan zero1 x tp2", "user plan ddp x tp2"])
def test_data_parallel_times_tensor_parallel_on_four_ranks_equals_one_process(four, name):
    ranks, _ = four
    _assert_equal_to_reference(ranks, name)
    assert [r[name]["dp"] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # tp innermost
    assert torch.equal(ranks[0][name]["seen"][0], ranks[1][name]["seen"][0])
    assert not torch.equal(ranks[0][name]["seen"][0], ranks[2][name]["seen"][0])


def test_checkpoint_of_zero3_x_tp2_resumes_under_ddp_on_two_ranks_and_continues_equal(four):
    ranks, resumed = four
    saved = ranks[0]["llama zero3 x tp2"]
    assert saved["global_step"] == 5
    for rank in resumed:
        assert rank["strategy"] == "ddp" and rank["global_step"] == 8
    ref = resumed[0]["reference"]  # one process, 8 steps straight
    torch.testing.assert_close(torch.tensor(ref["losses"][:5]), torch.tensor(saved["losses"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        torch.tensor(resumed[0]["losses"]), torch.tensor(ref["losses"][5:]), rtol=1e-4, atol=1e-5
    )
    for key, value in ref["state"].items():
        torch.testing.assert_close(resumed[0]["state"][key], value.float(), rtol=1e-4, atol=1e-4, msg=key)


def test_models_tensor_parallel_cannot_split_are_refused_at_prepare_on_every_rank():
    ranks = run_ranks("tests.dist.tp_workloads:refusals", 2, timeout=200)
    for rank in ranks:
        assert rank["no plan"].startswith("tp > 1, but TinyNet has no tensor-parallel plan")
        assert "HINT: give tp_plan={module name pattern: style}" in rank["no plan"]
        assert rank["no match"].startswith(
            "tp_plan pattern 'layers.*.attn.qq' matches no module of TinyLM "
            "(its modules: embed, layers, layers.0, layers.0.attn_norm"
        )
