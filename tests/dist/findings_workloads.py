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
    return {"losses": after, "resumed_losses": resumed,
            "weights": px.get_state_dict(model), "resumed_weights": px2.get_state_dict(model2)}


def python_values() -> dict[str, Any]:
    """px.reduce / px.gather of Python numbers, lists and dicts of them."""
    px = Phalanx()
    r = px.rank
    out: dict[str, Any] = {
        "mean": px.reduce(float(r + 1)), "sum": px.reduce(r + 1, "sum"),
        "list": px.reduce([1.0 * r, 2.0 * r], "sum"),
        "dict": px.reduce({"acc": 0.5 + r / 4, "n": [r, 1]}, "sum"),
        "gather": px.gather(float(r)), "gather_list": px.gather([r, r + 10]),
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
    return nn.functional.cross_entropy(output.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                       reduction="sum")


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
    model, optimizer, loader = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(p.make_data(), batch_size=PP_BATCH))
    losses = []
    for (batch,) in loader:
        if num_items:
            targets = _masked(batch[:, 1:])
            loss = px.forward_backward(model, batch[:, :-1], targets, summed_lm_loss,
                                       num_items=(targets != -100).sum())
        else:
            loss = px.forward_backward(model, batch[:, :-1], batch[:, 1:], p.lm_loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    evaluated = px.forward(model, p.make_data().tensors[0][:7, :-1])  # an eval batch of any size
    return {"losses": losses, "state": px.get_state_dict(model), "eval_rows": evaluated.shape[0],
            "global_step": px.global_step}


def tp_refusal() -> str:
    """tp 2 on a Llama with 3 key/value heads: refused at prepare with the numbers, on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    px = Phalanx(strategy="ddp", tp=2)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3)
    try:
        px.prepare(LlamaForCausalLM(config))
    except ValueError as error:
        return str(error)
    return "prepared"


# ---- sync_batchnorm over the data-parallel ranks only ------------------------------------------
def batchnorm_layout(settings: dict) -> dict[str, Any]:
    """batchnorm_workloads' CNN under `settings` (tp or pp), sync_batchnorm on: its state after an
    epoch of per-rank batches of 4 (the whole model on the main process)."""
    from tests.dist import batchnorm_workloads as b

    px = Phalanx(sync_batchnorm=True, seed=0, **settings)
    model = b.make_model()
    model, optimizer, loader = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.3),
                                          DataLoader(b.make_data(), batch_size=b.PER_RANK))
    for x, y in loader:
        px.forward_backward(model, x, y, nn.functional.cross_entropy)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in px.get_state_dict(model).items()}
