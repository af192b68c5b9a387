"""A tensor-parallel degree that does not divide the heads, key/value heads or MLP width is refused
at prepare with the numbers (a Llama with 2 key/value heads at tp 4 crashed in its forward)."""

import pytest

from phalanx.strategies import tensor_parallel, tp_fit
from phalanx.strategies.plan.parallel_plan import ParallelPlan


def _llama(heads: int, kv_heads: int, width: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=63,
        hidden_size=8 * heads,
        intermediate_size=width,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    model = LlamaForCausalLM(config)
    return model, tensor_parallel.match(model, tensor_parallel.model_plan(model, None))


def test_key_value_heads_that_tp_does_not_divide_are_named_with_the_degrees_that_fit():
    model, chosen = _llama(heads=4, kv_heads=2, width=64)
    with pytest.raises(ValueError) as error:
        tp_fit.check(model, ParallelPlan(preset="ddp", tp=4), chosen)
    assert str(error.value) == (
        "tp=4 does not divide the model's key/value heads (num_key_value_heads=2): each tensor-parallel rank must "
        "hold whole heads and an equal part of every split layer. HINT: choose tp among 1, 2"
    )
    tp_fit.check(
        model, ParallelPlan(preset="ddp", tp=2), chosen
    )  # fits; an odd vocabulary (63) is split unevenly by torch, and works


def test_heads_and_mlp_width_are_checked_too():
    model, chosen = _llama(heads=6, kv_heads=6, width=36)
    with pytest.raises(
        ValueError,
        match=r"tp=4 does not divide the model's attention heads \(num_attention_heads=6\), "
        r"key/value heads \(num_key_value_heads=6\): .* HINT: choose tp among 1, 2, 3, 6$",
    ):
        tp_fit.check(model, ParallelPlan(preset="ddp", tp=4), chosen)
    model, chosen = _llama(heads=4, kv_heads=4, width=30)
    with pytest.raises(
        ValueError,
        match=r"MLP width \(intermediate_size=30\), layer 'model.layers.0.mlp.gate_proj' "
        r"\(30 rows\)",
    ):
        tp_fit.check(model, ParallelPlan(preset="ddp", tp=4), chosen)
