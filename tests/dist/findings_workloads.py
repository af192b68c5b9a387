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
