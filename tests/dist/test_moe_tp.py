"""transformers' mixture-of-experts tensor-parallel styles (`packed_colwise` on the fused gate/up
expert weights, `rowwise` on the down ones, `moe_tp_experts` on the experts module) under `--tp 2`:
Qwen3-MoE and Mixtral with the router's load-balancing loss train equal to one process (loss and
grad norm per step, final weights), and what tp cannot split is refused at prepare."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]

CASES = {
    "qwen3_moe ddp tp2": {"family": "qwen3_moe", "strategy": "ddp", "tp": 2},
    "mixtral ddp tp2": {"family": "mixtral", "strategy": "ddp", "tp": 2},
    "packed_colwise on a module": {
        "family": "mixtral",
        "strategy": "ddp",
        "tp": 2,
        "tp_plan": {"model.layers.*.mlp.experts": "packed_colwise"},
    },
    "moe_tp_experts with whole weights": {
        "family": "qwen3_moe",
        "strategy": "ddp",
        "tp": 2,
        "tp_plan": {"model.layers.*.mlp.experts": "moe_tp_experts"},
    },
    "experts with sequence parallel": {"family": "qwen3_moe", "strategy": "ddp", "tp": 2, "sequence_parallel": True},
}
TRAINED = [name for name in CASES if "tp2" in name]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks("tests.dist.moe_tp_workloads:matrix", 2, args=(CASES,), timeout=500)


@pytest.mark.parametrize("name", TRAINED)
def test_moe_under_tp2_equals_one_process(ranks, name):
    ref = ranks[0][name]["reference"]
    for rank in ranks:
        run = rank[name]
        assert "refused" not in run, run.get("refused")
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=2e-4, atol=0)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=2e-4, atol=0)
    placements = ranks[0][name]["placements"]
    assert placements["model.layers.0.mlp.experts.gate_up_proj"] == ["_StridedShard(dim=1, sf=2)"]
    assert placements["model.layers.0.mlp.experts.down_proj"] == ["Shard(dim=2)"]
    state = ranks[0][name]["state"]
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        # AdamW's normalised steps amplify rounding on tiny gradients
        torch.testing.assert_close(state[key], value, rtol=2e-4, atol=1e-4, msg=key)


def test_what_tp_cannot_split_in_an_moe_is_refused_at_prepare(ranks):
    for rank in ranks:
        packed = rank["packed_colwise on a module"]["refused"]
        assert "'packed_colwise'" in packed and "MixtralForCausalLM" in packed and "zero3" in packed
        assert "HINT" in packed
        whole = rank["moe_tp_experts with whole weights"]["refused"]
        assert "'moe_tp_experts' on Qwen3MoeExperts" in whole and "gate_up_proj" in whole and "zero3" in whole
        sp = rank["experts with sequence parallel"]["refused"]
        assert "sequence_parallel" in sp and "Qwen3MoeForCausalLM" in sp and "HINT" in sp
