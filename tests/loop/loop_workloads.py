"""Run on every rank (and in-process as the world-of-one reference) by the training-loop tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx
from tests.dist.workloads import make_data, make_model


def make_scheduler(kind: str, optimizer: torch.optim.Optimizer, total_steps: int):
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total_steps)


def scheduled_training(
    per_rank_batch: int,
    accum: int,
    kind: str,
    epochs: int = 2,
    n: int = 40,
    strategy: str | None = None,
    remainder: str | None = None,
) -> dict:
    """SGD + a scheduler stepped on every loop iteration, as scripts do; the learning rate of every
    real optimizer step, the final weights and the step count."""
    px = Phalanx(seed=0, strategy=strategy, grad_accum_steps=accum, grad_accum_remainder=remainder)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = DataLoader(make_data(n), batch_size=per_rank_batch, shuffle=True)
    scheduler = make_scheduler(kind, optimizer, total_steps=6)
    model, optimizer, loader, scheduler = px.prepare(model, optimizer, loader, scheduler)
    lrs, batches = [], 0
    for _ in range(epochs):
        for x, y in loader:
            batches += 1
            with px.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                px.backward(loss)
                if px.sync_gradients:
                    lrs.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    state = {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}
    return {
        "lrs": lrs,
        "state": state,
        "global_step": px.global_step,
        "batches": batches,
        "last_epoch": scheduler.last_epoch,
        "strategy": px.strategy_name,
    }
