"""Expert parallel (`Phalanx(ep=2)`, `--ep 2`): transformers MoE models as they come, their experts
split over 2 gloo ranks (2 of 4 each) and tokens sent to them by all-to-all, train equal to one
process with no phalanx: per-step loss and grad norm (torch's clip_grad_norm_) within 2e-4, final
weights gathered to their one-process names and shapes. What ep cannot lay out is refused at prepare."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

EP2 = {"strategy": "ddp", "ep": 2}
CASES = {
    "qwen3_moe": {"family": "qwen3_moe", "settings": EP2},
    "mixtral": {"family": "mixtral", "settings": EP2},
    "dense model": {"family": "dense", "settings": EP2},
    "3 experts": {"family": "mixtral", "experts": 3, "settings": EP2},
}
MORE = {"olmoe": {"family": "olmoe", "settings": EP2}, "gpt_oss": {"family": "gpt_oss", "settings": EP2}}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks("tests.dist.ep_workloads:matrix", 2, args=(CASES,), timeout=400)


def _equal_to_one_process(ranks: list[dict], name: str) -> None:
    ref = ranks[0][name]["reference"]
    for rank in ranks:
        run = rank[name]
        assert "refused" not in run, run.get("refused")
        assert run["local_experts"] == [(2, *run["local_experts"][0][1:])]  # 2 of the 4 experts on each rank
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=2e-4, atol=0)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=2e-4, atol=0)
        state = run["state"]
        assert state.keys() == ref["state"].keys()
        for key, value in ref["state"].items():  # every expert back in its one-process place
            torch.testing.assert_close(state[key], value, rtol=2e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_ep2_equals_one_process(ranks, name):
    _equal_to_one_process(ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MORE))
def test_ep2_equals_one_process_olmoe_gpt_oss(name):
    _equal_to_one_process(_more(), name)


_more_ranks: list[dict] = []


def _more() -> list[dict]:
    if not _more_ranks:
        _more_ranks.extend(run_ranks("tests.dist.ep_workloads:matrix", 2, args=(MORE,), timeout=400))
    return _more_ranks


def test_what_ep_cannot_lay_out_is_refused_at_prepare(ranks):
    for rank in ranks:
        dense = rank["dense model"]["refused"]
        assert "ep=2" in dense and "LlamaForCausalLM has no mixture-of-experts layer" in dense and "HINT" in dense
        odd = rank["3 experts"]["refused"]
        assert "hold 3 experts each" in odd and "model.layers.0.mlp.experts" in odd and "HINT: choose ep among" in odd
