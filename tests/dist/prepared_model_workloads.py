"""Rank functions: the prepared model answers the user's module's own methods (generate, config,
save_pretrained), each compared with the same module in one process, no phalanx."""

from __future__ import annotations

import torch
from torch import nn

from phalanx import Phalanx

VOCAB, DIM, SEQ = 64, 16, 8
PROMPT = torch.tensor([[3, 17, 42, 5], [9, 1, 60, 33]])


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def generate(settings: dict) -> dict:
    """One training step on the same batch on every rank, then greedy `model.generate` on the
    prepared model; the reference is the same module and step in this process without phalanx."""
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    reference = tiny_llama()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    _one_step(reference, ref_opt, ids)
    reference.eval()
    with torch.no_grad():
        expected = reference.generate(PROMPT, max_new_tokens=6, do_sample=False)

    px = Phalanx(**settings)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = px.prepare(model, optimizer)
    _one_step(model, optimizer, ids)
    model.eval()
    with torch.no_grad():
        got = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
    return {
        "expected": expected,
        "got": got,
        "vocab": model.config.vocab_size,
        "has_save_pretrained": callable(getattr(model, "save_pretrained", None)),
    }


def save_pretrained(settings: dict, directory: str, every_rank: bool) -> dict:
    """One step, then `px.unwrap_model(model).save_pretrained(directory)` on every rank
    (transformers' convention), or first on the main process only (refused) and then on every rank;
    the main process loads it back with from_pretrained and compares it with the same step in one
    process."""
    from transformers import LlamaForCausalLM

    from phalanx.checkpoint import save_pretrained as saving

    saving.AGREE_SECONDS = 3.0  # the one-rank call is refused after this wait
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    reference = tiny_llama()
    _one_step(reference, torch.optim.SGD(reference.parameters(), lr=0.5), ids)

    px = Phalanx(**settings)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = px.prepare(model, optimizer)
    _one_step(model, optimizer, ids)
    refused = None
    if not every_rank:  # the main process alone first: refused; then every rank, which must still work
        if px.is_main_process:
            try:
                px.unwrap_model(model).save_pretrained(directory)
            except ValueError as e:
                refused = str(e)
        px.wait_for_everyone()
    px.unwrap_model(model).save_pretrained(directory)
    if not px.is_main_process:
        return {}
    loaded = LlamaForCausalLM.from_pretrained(directory).state_dict()
    expected = reference.state_dict()
    return {
        "refused": refused,
        "keys": sorted(loaded) == sorted(expected),
        "max_rel": max(((loaded[k] - v).norm() / v.norm()).item() for k, v in expected.items()),
    }
