"""Initial weights under `px.init_module()`: a tiny transformers Llama with a peft LoRA adapter built
with the same seed in a layout (on meta where the layout shards or cuts, materialised at prepare)
and in one process with no phalanx; rank 0 compares the gathered weights and the generator's next
draw (dropout and shuffles after the build must match too)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import Phalanx

SEED = 0


def build() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    )


def _one_process() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(SEED)
    model = build()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.rand(8)


def initial(settings: dict[str, Any]) -> dict[str, Any]:
    px = Phalanx(**settings)
    torch.manual_seed(SEED)
    with px.init_module():
        model = build()
    on_meta = any(p.is_meta for p in model.parameters())
    model = px.prepare(model)
    after = torch.rand(8)
    state = px.get_state_dict(model)
    if px.rank != 0:
        return {}
    reference, reference_after = _one_process()
    differ = sorted(k for k, v in reference.items() if k not in state or not torch.equal(state[k].float(), v.float()))
    lora_a = next(k for k in reference if ".lora_A." in k)
    return {
        "on_meta": on_meta,
        "differ": differ,
        "count": len(reference),
        "next_draw_equal": torch.equal(after, reference_after),
        "lora_a": (float(state[lora_a].float().abs().sum()), float(reference[lora_a].abs().sum())),
    }


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    return {name: initial(settings) for name, settings in cases.items()}
