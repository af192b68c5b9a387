"""Pipeline stages of transformers models cut from their own base_model_pp_plan (no tracing), also
inside a peft wrapper, in one process: the stages run one after another equal the whole model."""
from __future__ import annotations

import copy

import pytest
import torch

from phalanx.model.families import build
from phalanx.strategies import pipeline as pipe
from phalanx.strategies.pipeline import model_plan


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _stages_in_turn(whole: torch.nn.Module, num_stages: int) -> torch.Tensor:
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    h = x
    for index in range(num_stages):
        model = copy.deepcopy(whole)
        chain = model_plan.model_chain(model)
        model_plan.adapt_forward(model)
        (stage,) = pipe.cut_model(model, chain, pipe.split_stages(chain, num_stages), [index]).stages
        h = stage(h)
    return h


def test_the_chain_is_the_declared_plan_embedding_layers_norm_head():
    chain = model_plan.model_chain(build("llama-tied"))
    assert chain.names == ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    assert chain.blocks == "model.layers" and chain.num_blocks == 2


def test_inside_a_peft_wrapper_the_units_are_the_base_models_layers():
    chain = model_plan.model_chain(_lora(build("llama")))
    assert chain.names[0] == "base_model.model.model.embed_tokens" and chain.names[-1] == "base_model.model.lm_head"
    assert chain.blocks == "base_model.model.model.layers"


@pytest.mark.parametrize("family", ["llama-tied", "gemma3", "mistral"])
def test_two_stages_in_turn_equal_the_whole_model(family):
    torch.manual_seed(0)
    whole = build(family)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_stages_in_turn(whole, 2), whole(x).logits, rtol=0, atol=0)


def test_a_lora_model_cut_in_two_equals_the_whole_one():
    torch.manual_seed(0)
    whole = _lora(build("llama"))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_stages_in_turn(whole, 2), whole(x).logits, rtol=0, atol=0)


def test_a_transformers_model_without_a_plan_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel declares no base_model_pp_plan .* and cannot cut"):
        model_plan.model_chain(build("gpt2"))
