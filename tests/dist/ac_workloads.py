"""Activation checkpointing under zero2 and zero3 (issue 40): a 4-block MLP built as torch's docs
build one, its optimizer made from model.parameters() before px.prepare, against the same loop in one
process with no phalanx."""

from __future__ import annotations

import torch
from torch import nn

STEPS, BATCH, DIM = 3, 8, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(DIM, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 1, generator=g)


def one_process() -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch()
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def checkpointed(strategies: list[str]) -> dict:
    """Each strategy with activation_checkpointing=True: per-step losses (over the ranks) and the
    full weights, or the refusal."""
    from phalanx import Phalanx

    out = {}
    for strategy in strategies:
        px = Phalanx(strategy=strategy, activation_checkpointing=True)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before prepare, as torch's docs do
        try:
            model, optimizer = px.prepare(model, optimizer)
        except ValueError as refused:
            out[strategy] = {"refused": str(refused)}
            continue
        x, y = (t.chunk(px.world_size)[px.rank] for t in batch())
        losses = []
        for _ in range(STEPS):
            loss = nn.functional.mse_loss(model(x), y)
            px.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(px.reduce(loss.detach()).item())
        out[strategy] = {"losses": losses, "weights": px.get_state_dict(model)}
    return out
