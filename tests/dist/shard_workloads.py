"""Workloads for zero1's balance: a model whose embedding is most of its bytes (as in
bench/strategies.py), one step under ddp and zero1, each rank's model-state bytes reported."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import Phalanx


def big_embedding_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(4096, 32), nn.Flatten(), nn.Linear(32 * 4, 32), nn.ReLU(), nn.Linear(32, 4))


def one_step_bytes(strategies: tuple[str, ...] = ("ddp", "zero1")) -> dict[str, Any]:
    out = {}
    for strategy in strategies:
        px = Phalanx(strategy=strategy)
        model = big_embedding_model()
        model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(px.rank)
        x, y = torch.randint(0, 4096, (8, 4), generator=g), torch.randint(0, 4, (8,), generator=g)
        px.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        out[strategy] = {
            "bytes": vars(px.memory_report(model, optimizer)).copy(),
            "weights": {k: v.clone() for k, v in px.get_state_dict(model).items()},
        }
    return out
