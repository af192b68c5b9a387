"""The step kernel phalanx chooses for a script's AdamW with nothing set, under each data-parallel
layout, on a model whose parameters split unevenly over 2 ranks (a 3-row, a 1-row and a 7-row
weight: one rank's shard of the 1-row weight is empty), and the weights it trains to against the
same loop in one process with no phalanx (torch's own per-parameter step)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from phalanx import Phalanx

STEPS, BATCH = 4, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1), nn.Tanh(), nn.Linear(1, 7))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, 5, generator=torch.Generator().manual_seed(step))


def _one_process() -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    for step in range(STEPS):
        model(_batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return copy.deepcopy(model.state_dict())


def train(strategy: str) -> dict[str, Any]:
    px = Phalanx(strategy=strategy)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    model, optimizer = px.prepare(model, optimizer)
    kernels = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
    share = BATCH // px.world_size
    for step in range(STEPS):
        rows = _batch(step)[px.rank * share : (px.rank + 1) * share]
        px.backward(model(rows).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    state = px.get_state_dict(model)
    return {"kernels": kernels, "state": state, "reference": _one_process() if px.rank == 0 else None}
