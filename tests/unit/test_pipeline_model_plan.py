"""Pipeline stages of transformers models cut from their own base_model_pp_plan (no tracing), also
inside a peft wrapper, in one process: the stages run one after another equal the whole model."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.layouts.families import build
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
        model_plan.adapt_forward(model, chain)
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


def _encoder(kind: str) -> torch.nn.Module:
    """Tiny stock transformers models that declare no base_model_pp_plan (built locally, no download)."""
    import transformers as tf

    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(**shape))
    if kind == "modernbert":
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        return tf.ModernBertForMaskedLM(tf.ModernBertConfig(**shape, **ids, local_attention=8))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
        )
    return build(kind)


@pytest.mark.parametrize(
    "kind, name",
    [
        ("gpt2", "GPT2LMHeadModel"),
        ("bert", "BertForMaskedLM"),
        ("modernbert", "ModernBertForMaskedLM"),
        ("t5", "T5ForConditionalGeneration"),
    ],
)
def test_a_transformers_model_without_a_plan_is_refused_naming_it_and_the_way(kind: str, name: str):
    with pytest.raises(ValueError) as refused:
        model_plan.model_chain(_encoder(kind))
    message = str(refused.value)
    assert f"{name} declares no pipeline layout (transformers' `base_model_pp_plan`" in message
    assert "pp_split setting" in message and f"HINT: train {name} without pp" in message
    assert "co_varnames" not in message and "traced" not in message  # torch.fx's words: nothing a user can act on


def test_what_the_head_does_after_its_layer_stays_on_the_last_stage():
    # Gemma2 soft-caps its logits after lm_head (final_logit_softcapping): on a stage before the last,
    # whose lm_head is a pass-through, that must not touch the hidden state handed on
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.5,
        attn_implementation="eager",
    )
    whole = transformers.Gemma2ForCausalLM(config)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_stages_in_turn(whole, 2), whole(x).logits, rtol=0, atol=0)
