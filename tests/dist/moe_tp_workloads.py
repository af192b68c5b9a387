"""Training runs for the mixture-of-experts tensor-parallel test: tiny Qwen3-MoE and Mixtral (4
experts, top 2, the router's load-balancing loss in the loss) trained with transformers' own loop
(`labels=`, `loss.backward()`, torch's `clip_grad_norm_`) under `--tp 2`, with the same loop in one
process and no phalanx computed in rank 0 on the same batches."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx
from tests.dist import ep_workloads
from tests.dist.tp_workloads import make_data

STEPS, BATCH, LR, MAX_NORM, AUX = 4, 8, 1e-2, 1.0, 0.02


def make_model(family: str) -> nn.Module:
    """The tiny MoE model of the ep tests, its router's load-balancing loss in the loss (coefficient 0.02)."""
    return ep_workloads.make_model(family, aux=AUX)


def _norm(value: Any) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _loop(model: nn.Module, optimizer: Any, batches: Any, backward: Any, mean: Any) -> dict[str, list[float]]:
    losses, norms = [], []
    for (batch,) in batches:
        loss = model(input_ids=batch, labels=batch).loss
        backward(loss)
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(mean(loss.detach())))
        if len(losses) == STEPS:
            break
    return {"losses": losses, "norms": norms}


def train(family: str, **settings: Any) -> dict[str, Any]:
    """STEPS AdamW steps under `settings`, or what prepare refused; rank 0 adds the one-process run."""
    px = Phalanx(**settings)
    model = make_model(family)
    start = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        loader = DataLoader(make_data(), batch_size=BATCH // px.dp_size)
        model, optimizer, loader = px.prepare(model, optimizer, loader)
    except ValueError as error:
        return {"refused": str(error)}
    out: dict[str, Any] = _loop(model, optimizer, loader, px.backward, lambda loss: px.reduce(loss, "mean"))
    out["placements"] = {
        n: [repr(pl) for pl in p.placements]
        for n, p in px.unwrap_model(model).named_parameters()
        if hasattr(p, "placements")
    }
    out["state"] = {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()}
    if px.rank == 0:
        ref_opt = torch.optim.AdamW(start.parameters(), lr=LR)
        whole = DataLoader(make_data(), batch_size=BATCH)
        out["reference"] = _loop(start, ref_opt, whole, lambda loss: loss.backward(), lambda loss: loss)
        out["reference"]["state"] = {k: v.detach().clone().float() for k, v in start.state_dict().items()}
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank: one process group serves them all."""
    return {name: train(**kwargs) for name, kwargs in cases.items()}
