"""The mask the cut attention rebuilds for a transformers model is the one the model builds in one
process: each model run through phalanx's attention function over a one-rank layout (the same code
every cp rank runs, masks from global positions) equals its own sdpa forward. ModernBERT's sliding
window looks both ways; packed documents count where transformers reads them; layer kinds whose mask
the cut cannot rebuild are refused at prepare."""

from __future__ import annotations

import copy

import pytest
import torch

from phalanx.strategies.context import hf
from phalanx.strategies.context.layout import using_layout
from phalanx.strategies.context.shard import shard_sequence
from tests.dist.cp_workloads import tiny_encoder, tiny_llama

SEQ = 32


def _routed_equals_own(model: torch.nn.Module, inputs: dict) -> None:
    own = copy.deepcopy(model).eval()
    model.eval()
    hf.route(model)
    local, _, layout = shard_sequence(inputs, cp_size=1, cp_rank=0, activate=False)
    with torch.no_grad(), using_layout(layout):
        got = model(**local).logits
    with torch.no_grad():
        want = own(**inputs).logits
    keep = inputs.get("attention_mask", torch.ones(got.shape[:2])).bool()  # padded queries: any value
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 64, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def test_modernbert_window_looks_both_ways_with_padding() -> None:
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -9:] = 0
    _routed_equals_own(tiny_encoder("modernbert"), {"input_ids": _ids(), "attention_mask": mask})


def test_a_bidirectional_model_reads_no_documents_from_position_ids() -> None:
    positions = torch.tensor([*range(12), *range(20)]).expand(2, SEQ)  # transformers' bidirectional masks ignore it
    _routed_equals_own(tiny_encoder("modernbert"), {"input_ids": _ids(), "position_ids": positions})


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_causal_model_reads_documents_only_without_an_attention_mask(with_mask: bool) -> None:
    positions = torch.tensor([*range(12), *range(20)]).expand(2, SEQ)
    inputs = {"input_ids": _ids(), "position_ids": positions, "use_cache": False}
    if with_mask:
        inputs["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long)
    _routed_equals_own(tiny_llama(), inputs)


@pytest.mark.parametrize("cache", [{"use_cache": False}, {}, {"use_cache": True}], ids=["off", "default", "on"])
def test_packed_documents_count_only_in_a_forward_without_a_cache(cache: dict) -> None:
    # transformers' masking_utils reads packed documents only when no cache is given, and use_cache
    # defaults to the config's True: with it one process attends across documents, so must the cut
    positions = torch.tensor([*range(12), *range(20)]).expand(2, SEQ)
    _routed_equals_own(tiny_llama(), {"input_ids": _ids(), "position_ids": positions, **cache})


def test_gradient_checkpointing_in_training_reads_documents_as_one_process() -> None:
    # merge_with_config_defaults turns use_cache off under gradient checkpointing in training
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    own = copy.deepcopy(model).train()
    model.train()
    hf.route(model)
    inputs = {"input_ids": _ids(), "position_ids": torch.tensor([*range(12), *range(20)]).expand(2, SEQ)}
    local, _, layout = shard_sequence(inputs, cp_size=1, cp_rank=0, activate=False)
    with using_layout(layout):
        got = model(**local).logits
    torch.testing.assert_close(got, own(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_chunked_attention_is_refused_naming_the_model() -> None:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=1,
        attention_chunk_size=8,
        no_rope_layers=[0, 1],
    )
    model = Llama4ForCausalLM(config)
    with pytest.raises(
        ValueError,
        match=r"Llama4ForCausalLM has layers of kind chunked_attention .*Llama4-style.*"
        r"HINT: run Llama4ForCausalLM with cp=1",
    ):
        hf.route(model)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3", "gemma3-bidirectional"])
def test_each_family_with_padding(name: str) -> None:
    """Causal (Llama), a window back (Mistral, Gemma3's sliding layers), a window both ways (Gemma3's
    use_bidirectional_attention), each with a left-padded row."""
    import transformers

    from tests.layouts.families import build

    torch.manual_seed(0)
    if name == "gemma3-bidirectional":
        model = transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=4,
                use_bidirectional_attention=True,
            )
        )
    else:
        model = build(name)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    _routed_equals_own(model, {"input_ids": _ids(), "attention_mask": mask, "use_cache": False})
