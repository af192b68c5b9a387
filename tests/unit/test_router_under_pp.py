"""The router's load-balancing loss under pp is refused at prepare with the way (issue 51): each stage
sees only its own layers' router logits and the last stage's `out.aux_loss` is None, so a loss_fn
adding `out.aux_loss * router_aux_loss_coef` dropped the term silently (Mixtral under pp 2: step-0
loss 5.5737 against one process's 5.6137). No process group: the check reads the model."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from phalanx.model.router_balance import pipeline_refusal


def _mixtral(router_logits: bool) -> torch.nn.Module:
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=router_logits,
        router_aux_loss_coef=0.02,
    )
    with torch.device("meta"):
        return MixtralForCausalLM(config)


def test_the_router_loss_under_pp_is_refused_with_the_way():
    why = pipeline_refusal(_mixtral(True), pp=2)
    assert why is not None and "cannot train under pp=2" in why and "HINT:" in why
    assert "output_router_logits=False" in why and "without pp" in why


@pytest.mark.parametrize("router_logits, pp", [(True, 1), (False, 2)])
def test_without_pp_or_without_the_router_loss_nothing_is_refused(router_logits, pp):
    assert pipeline_refusal(_mixtral(router_logits), pp=pp) is None


def test_a_model_without_a_router_is_never_refused():
    assert pipeline_refusal(torch.nn.Linear(2, 2), pp=2) is None
