"""Rank functions: torch's idioms inside `px.uneven_inputs(model)` (torch's Join) under ddp and
zero1, against the same loop in one process with no phalanx (issue 40)."""

from __future__ import annotations

import torch
from torch import nn

from phalanx import Phalanx

NUM_BATCHES = (3, 5)  # rank 0 runs out after 3 batches, rank 1 after 5
BATCH, DIM = 4, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank: int, count: int | None = None, seed: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + rank)
    return [
        (torch.randn(BATCH, DIM, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(NUM_BATCHES[rank] if count is None else count)
    ]


def reference() -> dict:
    """One process, no phalanx: step t trains on the batches of the ranks that still have one, each
    rank's mean loss divided by the 2 ranks (torch's Join: a finished rank contributes zeros)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = [_batches(r) for r in range(len(NUM_BATCHES))]
    losses, norms = [], []
    for t in range(max(NUM_BATCHES)):
        per_rank = [nn.functional.cross_entropy(model(x), y) for x, y in (d[t] for d in data if t < len(d))]
        (sum(per_rank) / len(NUM_BATCHES)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "norms": norms, "params": [p.detach().clone() for p in model.parameters()]}


def uneven_loop(strategy: str, verbs: bool = True) -> dict:
    """The README's logging pattern inside px.uneven_inputs: px.reduce / px.gather / px.log each
    step (`verbs`; without them: the training alone)."""
    px = Phalanx(strategy=strategy)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = px.prepare(model, optimizer)
    reduced, gathered, norms = [], [], []
    with px.uneven_inputs(model) as uneven:
        for x, y in uneven.iter(_batches(px.rank)):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item())
            optimizer.step()
            optimizer.zero_grad()
            if not verbs:
                continue
            mean = px.reduce(loss.detach())
            reduced.append(mean.item())
            gathered.append(px.gather(loss.detach()).tolist())
            px.log({"loss": mean.item()})
    params = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in px.unwrap_model(model).parameters()
    ]
    return {"reduced": reduced, "gathered": gathered, "norms": norms, "params": params}


EVEN_BATCHES = 2  # the second epoch: both ranks have as many


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)  # closed form: reads its own count


def two_epochs_reference() -> dict:
    """One process, no phalanx: the uneven epoch as `reference`, then an even one, AdamW with a
    LambdaLR stepped after every optimizer step."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = _schedule(optimizer)
    data = [_batches(r) for r in range(len(NUM_BATCHES))]
    even = [_batches(r, EVEN_BATCHES, seed=200) for r in range(len(NUM_BATCHES))]
    for epoch in (data, even):
        for t in range(max(len(d) for d in epoch)):
            per_rank = [nn.functional.cross_entropy(model(x), y) for x, y in (d[t] for d in epoch if t < len(d))]
            (sum(per_rank) / len(NUM_BATCHES)).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    return {"lr": scheduler.get_last_lr(), "params": [p.detach().clone() for p in model.parameters()]}


def two_epochs(strategy: str) -> dict:
    """The same two epochs, each inside px.uneven_inputs, the scheduler prepared with the rest."""
    px = Phalanx(strategy=strategy)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, scheduler = px.prepare(model, optimizer, _schedule(optimizer))
    for batches in (_batches(px.rank), _batches(px.rank, EVEN_BATCHES, seed=200)):
        try:
            uneven_inputs = px.uneven_inputs(model)
        except ValueError as refused:
            return {"refused": str(refused)}
        with uneven_inputs as uneven:
            for x, y in uneven.iter(batches):
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
    return {"lr": scheduler.get_last_lr(), "params": [p.detach().clone() for p in px.unwrap_model(model).parameters()]}
