"""Rank functions for the probed findings of issue 26: each a feature right alone and wrong beside
another. One launch runs several of them in turn (tests.dist.harness_calls)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx
from tests.dist.strategy_workloads import make_data, make_model, make_optimizer


def _steps(px: Phalanx, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, n: int) -> list[float]:
    losses = []
    for _, (x, y) in zip(range(n), loader):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        px.backward(loss)
        optimizer.step()
        losses.append(px.reduce(loss.detach()).item())
    return losses


def resume_then_train(strategy: str, checkpoint: str) -> dict[str, Any]:
    """3 steps, save, 3 more; then a fresh run (other initial weights) loads the checkpoint and takes
    the same 3 steps: its losses and weights must be the first run's."""

    def build(seed: int):
        px = Phalanx(strategy=strategy, seed=0)
        model = make_model(seed)
        loader = DataLoader(make_data(), batch_size=4, shuffle=True)
        return (px, *px.prepare(model, make_optimizer(model), loader))

    px, model, optimizer, loader = build(0)
    batches = iter(loader)
    _steps(px, model, optimizer, batches, 3)
    px.save_state(checkpoint)
    after = _steps(px, model, optimizer, batches, 3)
    px2, model2, optimizer2, loader2 = build(1)
    assert px2.load_state(checkpoint)
    resumed = _steps(px2, model2, optimizer2, iter(loader2), 3)
    return {
        "losses": after,
        "resumed_losses": resumed,
        "weights": px.get_state_dict(model),
        "resumed_weights": px2.get_state_dict(model2),
    }


def python_values() -> dict[str, Any]:
    """px.reduce / px.gather of Python numbers, lists and dicts of them."""
    px = Phalanx()
    r = px.rank
    out: dict[str, Any] = {
        "mean": px.reduce(float(r + 1)),
        "sum": px.reduce(r + 1, "sum"),
        "list": px.reduce([1.0 * r, 2.0 * r], "sum"),
        "dict": px.reduce({"acc": 0.5 + r / 4, "n": [r, 1]}, "sum"),
        "gather": px.gather(float(r)),
        "gather_list": px.gather([r, r + 10]),
    }
    try:
        px.reduce("text")
        out["refused"] = None
    except TypeError as error:
        out["refused"] = str(error)
    return out


# ---- pp: the short last batch, num_items --------------------------------------------------------
PP_BATCH = 30  # 96 samples: 3 batches of 30 (cut into 3 microbatches, not 4) and a last one of 6


def _masked(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets with every token divisible by 3 ignored: the batches' counts differ."""
    return tokens.masked_fill(tokens % 3 == 0, -100)


def summed_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        output.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
    )


def pp_reference(num_items: bool) -> dict[str, Any]:
    from tests.dist import pp_workloads as p

    model = p.make_model(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for (batch,) in DataLoader(p.make_data(), batch_size=PP_BATCH):
        targets = _masked(batch[:, 1:])
        if num_items:
            loss = summed_lm_loss(model(batch[:, :-1]), targets)
            (loss / (targets != -100).sum()).backward()
        else:
            loss = p.lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def pp_epoch(num_items: bool) -> dict[str, Any]:
    """pp 2: an epoch of batches of 30 (the last one 6), by mean loss or summed with num_items."""
    from tests.dist import pp_workloads as p

    px = Phalanx(strategy="ddp", pp=2)
    model = p.make_model(2)
    model, optimizer, loader = px.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(p.make_data(), batch_size=PP_BATCH)
    )
    losses = []
    for (batch,) in loader:
        if num_items:
            targets = _masked(batch[:, 1:])
            loss = px.forward_backward(model, batch[:, :-1], targets, summed_lm_loss, num_items=(targets != -100).sum())
        else:
            loss = px.forward_backward(model, batch[:, :-1], batch[:, 1:], p.lm_loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    evaluated = px.forward(model, p.make_data().tensors[0][:7, :-1])  # an eval batch of any size
    return {
        "losses": losses,
        "state": px.get_state_dict(model),
        "eval_rows": evaluated.shape[0],
        "global_step": px.global_step,
    }


def tp_refusal() -> str:
    """tp 2 on a Llama with 3 key/value heads: refused at prepare with the numbers, on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    px = Phalanx(strategy="ddp", tp=2)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
    )
    try:
        px.prepare(LlamaForCausalLM(config))
    except ValueError as error:
        return str(error)
    return "prepared"


# ---- sync_batchnorm over the data-parallel ranks only ------------------------------------------
def batchnorm_layout(settings: dict) -> dict[str, Any]:
    """batchnorm_workloads' CNN under `settings` (tp or pp), sync_batchnorm on: its state after an
    epoch of per-rank batches of 4 (the whole model on the main process), or what prepare refused."""
    from tests.dist import batchnorm_workloads as b

    px = Phalanx(sync_batchnorm=True, seed=0, **settings)
    model = b.make_model()
    try:
        model, optimizer, loader = px.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.3), DataLoader(b.make_data(), batch_size=b.PER_RANK)
        )
    except ValueError as error:  # pp: refused (statistics of one microbatch are not the global batch's)
        return {"refused": str(error)}
    for x, y in loader:
        px.forward_backward(model, x, y, nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in px.get_state_dict(model).items()}


# ---- LoRA under tensor parallel ----------------------------------------------------------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama() -> nn.Module:
    """tp_workloads' tiny Llama with rank-4 LoRA adapters; B drawn non-zero so the adapters act from step 1."""
    from peft import LoraConfig, get_peft_model

    from tests.dist.tp_workloads import make_model

    model = get_peft_model(
        make_model("llama"),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def merged(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights `state` put into a fresh LoRA model, merged (as the example's export does)."""
    cpu = lora_llama()
    cpu.load_state_dict(state)
    return {k: v.detach().clone() for k, v in cpu.merge_and_unload().state_dict().items()}


def lora_train(tp: int, steps: int = 3) -> dict[str, Any]:
    """AdamW on the adapters, batches of 8 sequences (the whole batch on every rank under tp alone)."""
    from tests.dist.tp_workloads import lm_loss, make_data

    px = Phalanx(strategy="ddp", tp=tp) if tp > 1 else None
    model = lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if px is not None:
        model, optimizer = px.prepare(model, optimizer)
    losses = []
    for _, (batch,) in zip(range(steps), DataLoader(make_data(), batch_size=8)):
        output = model(input_ids=batch[:, :-1])
        loss = lm_loss(output, batch[:, 1:])
        px.backward(loss) if px is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = px.get_state_dict(model) if px is not None else model.state_dict()
    out: dict[str, Any] = {"losses": losses}
    if px is not None:  # how each part of an adapted layer is split: "Shard(0)", "Shard(1)", or "whole"
        attn = px.unwrap_model(model).base_model.model.model.layers[0].self_attn
        out["layouts"] = {
            f"{proj}.{part}": str(list(getattr(w, "placements", ["whole"])))
            for proj in ("q_proj", "o_proj")
            for part, w in (
                ("base_layer", getattr(attn, proj).base_layer.weight),
                ("lora_A", getattr(attn, proj).lora_A["default"].weight),
                ("lora_B", getattr(attn, proj).lora_B["default"].weight),
            )
        }
    if px is None or px.is_main_process:
        out["merged"] = merged(model, {k: v.detach().float() for k, v in state.items()})
    return out


def fp16_tp() -> dict[str, Any]:
    """fp16 under tp 2 on 2 processes (dp 1): the grad scaler's unscale met split and whole gradients."""
    from tests.dist.tp_workloads import TINY_LM_PLAN, train

    return train("tinylm", 8, 3, 1e-2, strategy="ddp", tp=2, tp_plan=TINY_LM_PLAN, mixed_precision="fp16")
