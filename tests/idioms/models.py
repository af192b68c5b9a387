"""Tiny models and data for the idiom corpus: built from a config with a fixed seed (the same
weights in every process), small enough that a cell takes about a second on one CPU core."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, SEQ, BATCH = 64, 16, 8
"""vocabulary, tokens per row (a multiple of 2 x cp for cp's balanced cut), global batch (rows)."""
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=4 * SEQ,
)


def llama(tied: bool = False) -> nn.Module:
    """transformers' LlamaForCausalLM, 2 layers; `tied`: its output layer is its embedding."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_SHAPE, tie_word_embeddings=tied, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def lora() -> nn.Module:
    """The Llama in peft's LoRA (r 4 on q_proj and v_proj; B random, so every adapter moves from step 1)."""
    import peft

    model = llama()
    torch.manual_seed(2)
    return peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )


def qwen3_moe() -> nn.Module:
    """A mixture of experts: Qwen3-MoE, 4 experts, top 2, without the router's load-balancing loss."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **_SHAPE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        output_router_logits=False,
        attn_implementation="eager",
    )
    return transformers.Qwen3MoeForCausalLM(config)


def gemma2() -> nn.Module:
    """Gemma2 with a small attention softcap (so it bites) and a sliding window shorter than a row."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        **_SHAPE,
        attn_logit_softcapping=1.0,
        sliding_window=6,
        initializer_range=0.1,
        query_pre_attn_scalar=8,
        attn_implementation="eager",
    )
    return transformers.Gemma2ForCausalLM(config)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def tokens(rows: int = 4 * BATCH) -> TensorDataset:
    """Rows of SEQ + 1 tokens (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g))


def pairs(n: int) -> TensorDataset:
    """(x, y) regression pairs for the MLP."""
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
