"""The router's load-balancing loss of a mixture-of-experts model (transformers' `output_router_logits`,
`router_aux_loss_coef`) is the whole global batch's in every data-parallel layout: per-step loss,
aux loss and grad norm equal one process with no phalanx (Qwen3-MoE and Mixtral, with and without
padding, under ddp, zero3 and cp 2 (the docs' hand-written cut, whose padding the model never sees);
zero3 x tp 2 and zero3 x cp 2 on 4 ranks in the second tier)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

TWO = {
    "qwen3_moe ddp": {"family": "qwen3_moe", "strategy": "ddp"},
    "qwen3_moe ddp padded": {"family": "qwen3_moe", "strategy": "ddp", "padded": True},
    "mixtral zero3": {"family": "mixtral", "strategy": "zero3"},
    "qwen3_moe cp2 padded": {"family": "qwen3_moe", "strategy": "ddp", "cp": 2, "padded": True},
}
JOIN = {"qwen3_moe ddp in Join": {"family": "qwen3_moe", "strategy": "ddp", "join": True}}
FOUR = {
    "qwen3_moe zero3 x tp2": {"family": "qwen3_moe", "strategy": "zero3", "tp": 2},
    "mixtral zero3 x cp2 padded": {"family": "mixtral", "strategy": "zero3", "cp": 2, "padded": True},
}


def _equal(ranks: list[dict], name: str) -> None:
    ref = ranks[0][name]["reference"]
    for rank in ranks:
        run = rank[name]
        for key in ("losses", "aux", "norms"):
            torch.testing.assert_close(
                torch.tensor(run[key]),
                torch.tensor(ref[key]),
                rtol=2e-4,
                atol=0,
                msg=lambda m, key=key: f"{name} {key}: {m}",
            )


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks("tests.dist.moe_aux_workloads:matrix", 2, args=({**TWO, **JOIN},), timeout=500)


@pytest.mark.parametrize("name", list(TWO))
def test_router_loss_is_the_global_batchs_on_two_ranks(two_ranks, name):
    _equal(two_ranks, name)


def test_router_loss_inside_torch_join_is_refused_naming_the_way(two_ranks):
    """Join's finished ranks shadow DDP's all-reduces only: the router loss's own would hang."""
    for rank in two_ranks:
        message = rank["qwen3_moe ddp in Join"].get("refused", "")
        assert "router load-balancing loss" in message and "method='agree'" in message and "HINT" in message


@pytest.mark.slow
def test_router_loss_is_the_global_batchs_under_zero3_x_tp2():
    ranks = run_ranks("tests.dist.moe_aux_workloads:matrix", 4, args=(FOUR,), timeout=500)
    for name in FOUR:
        _equal(ranks, name)
