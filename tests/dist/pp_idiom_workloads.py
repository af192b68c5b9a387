"""A transformers loop written as transformers' and torch's docs write it (a `loss_fn` reading
`out.logits`, `torch.nn.utils.clip_grad_norm_` on the model's parameters, `save_pretrained` on every
rank), run under pp 2 and in one process with no phalanx, on a tiny Llama built from its config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, SAMPLES, GLOBAL_BATCH, STEPS = 64, 8, 32, 8, 3
LR, MAX_NORM = 1e-2, 0.5  # below every step's norm: torch's clip acts on each step


def make_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g))


def eval_inputs() -> torch.Tensor:
    return make_data().tensors[0][:4, :-1]


def loss_fn(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """As a transformers loop writes it: the model returns its output object."""
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _loop(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, forward_backward: Any) -> dict[str, Any]:
    """STEPS steps: `forward_backward(x, y)` (the loss, after its backward), torch's own clip on the
    model's parameters, the optimizer's step."""
    losses, norms = [], []
    for step, (batch,) in enumerate(loader):
        loss = forward_backward(batch[:, :-1], batch[:, 1:])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == STEPS:
            break
    return {"losses": losses, "norms": norms}


def reference() -> dict[str, Any]:
    """One process, plain transformers and torch: the losses, torch's clip norms and the weights."""
    model = make_model()

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out = _loop(model, optimizer, DataLoader(make_data(), batch_size=GLOBAL_BATCH), forward_backward)
    with torch.no_grad():
        out["eval"] = model(eval_inputs()).logits
    return dict(out, state={k: v.detach().clone() for k, v in model.state_dict().items()})


def train_pp(save_dir: str) -> dict[str, Any]:
    """pp 2: the same loop through px.forward_backward, torch's clip on the prepared model's
    parameters, then `px.unwrap_model(model).save_pretrained(save_dir)` on every rank."""
    from phalanx import Phalanx

    px = Phalanx(strategy="ddp", pp=2)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(make_data(), batch_size=GLOBAL_BATCH)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    out = _loop(model, optimizer, loader, lambda x, y: px.forward_backward(model, x, y, loss_fn))
    with torch.no_grad():
        out["eval"] = px.forward(model, eval_inputs()).logits  # the model's output object, as in one process
    px.unwrap_model(model).save_pretrained(save_dir)
    return out


def fp16_norms() -> dict[str, dict[str, list[float]]]:
    """Under mixed_precision="fp16" (phalanx's loss scale): the norms torch's own clip gives on the
    prepared model's parameters, and px.clip_grad_norm_'s in the same layout, pp 2 and ddp."""
    from phalanx import Phalanx

    out: dict[str, dict[str, list[float]]] = {}
    for layout, settings in (("pp 2", {"pp": 2}), ("ddp", {})):
        for clip in ("torch", "px"):
            px = Phalanx(strategy="ddp", mixed_precision="fp16", **settings)
            model = make_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            loader = DataLoader(make_data(), batch_size=GLOBAL_BATCH // px.dp_size)
            model, optimizer, loader = px.prepare(model, optimizer, loader)
            clip_fn = torch.nn.utils.clip_grad_norm_ if clip == "torch" else px.clip_grad_norm_
            norms = []
            for _, (batch,) in zip(range(3), loader):
                px.forward_backward(model, batch[:, :-1], batch[:, 1:], loss_fn)
                norms.append(float(clip_fn(model.parameters(), MAX_NORM)))
                optimizer.step()
                optimizer.zero_grad()
            out.setdefault(layout, {})[clip] = norms
    return out


def idioms(save_dir: str) -> dict[str, Any]:
    """`train_pp`, `save_on_one_rank`, `lora_pp`, then `fp16_norms` in the same process group (one spawn for all)."""
    out = train_pp(f"{save_dir}/every_rank")
    out["one_rank"] = save_on_one_rank(f"{save_dir}/one_rank")
    out["lora"] = lora_pp(f"{save_dir}/lora")
    out["fp16"] = fp16_norms()
    return out


def lora_model() -> nn.Module:
    """The tiny Llama with peft's LoRA on q_proj and v_proj, B not zero (so every adapter tensor moves)."""
    from peft import LoraConfig, get_peft_model

    model = make_model()
    torch.manual_seed(2)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def _lora_steps(model: nn.Module, optimizer: Any, loader: Any, forward_backward: Any) -> list[float]:
    losses = []
    for step, (batch,) in enumerate(loader):
        losses.append(forward_backward(batch[:, :-1], batch[:, 1:]).item())
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == STEPS:
            break
    return losses


def lora_reference(save_dir: str) -> list[float]:
    """One process, plain peft: STEPS steps of the LoRA model, then peft's own save_pretrained."""
    model = lora_model()

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = _lora_steps(model, optimizer, DataLoader(make_data(), batch_size=GLOBAL_BATCH), forward_backward)
    model.save_pretrained(save_dir)
    return losses


def lora_pp(save_dir: str) -> list[float]:
    """pp 2: the LoRA loop, then `px.unwrap_model(model).save_pretrained(save_dir)` on every rank,
    as peft's docs call it."""
    from phalanx import Phalanx

    px = Phalanx(strategy="ddp", pp=2)
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = DataLoader(make_data(), batch_size=GLOBAL_BATCH)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    losses = _lora_steps(model, optimizer, loader, lambda x, y: px.forward_backward(model, x, y, loss_fn))
    px.unwrap_model(model).save_pretrained(save_dir)
    return losses


def save_on_one_rank(save_dir: str) -> dict[str, Any]:
    """pp 2: save_pretrained on the main process only (transformers' convention is every rank)."""
    from phalanx import Phalanx
    from phalanx.strategies.pipeline import save

    save.ARRIVAL_WAIT_S = 3.0  # the other rank never comes: no need to wait the default 30 s
    px = Phalanx(strategy="ddp", pp=2)
    model = px.prepare(make_model())
    out: dict[str, Any] = {}
    if px.is_main_process:
        try:
            px.unwrap_model(model).save_pretrained(save_dir)
        except ValueError as error:
            out["refused"] = str(error)
    px.wait_for_everyone()
    return out
