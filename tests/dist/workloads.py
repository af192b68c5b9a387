"""Functions run on every rank by tests.dist.harness (and in-process as world-of-one references)."""

from __future__ import annotations

import contextlib
import io

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx


def make_data(n: int = 64, features: int = 13, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))


def train(global_batch: int, epochs: int, shuffle: bool = True, strategy: str | None = None) -> dict:
    """Train the wine-sized MLP; returns final parameters and the per-step mean losses."""
    px = Phalanx(strategy=strategy)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(make_data(), batch_size=global_batch // px.world_size, shuffle=shuffle)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            px.backward(loss)
            optimizer.step()
            losses.append(px.reduce(loss.detach(), "mean").item())
    state = {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}
    return {"state": state, "losses": losses, "strategy": px.strategy_name}


def indices_seen(n: int, batch_size: int, shuffle: bool, drop_last: bool, epochs: int) -> dict:
    """Which dataset indices this rank sees per epoch, and what gather_for_metrics returns."""
    px = Phalanx()
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    loader = px.prepare(loader)
    per_epoch, gathered, num_batches = [], [], []
    for _ in range(epochs):
        seen, metrics = [], []
        for (idx,) in loader:
            seen += idx.tolist()
            metrics += px.gather_for_metrics(idx).tolist()
        per_epoch.append(seen)
        gathered.append(metrics)
        num_batches.append(len(loader))
    return {"rank": px.rank, "per_epoch": per_epoch, "gathered": gathered, "num_batches": num_batches}


def collectives() -> dict:
    px = Phalanx()
    r = px.rank
    ragged = torch.full((r + 1, 2), float(r))  # rank 0 holds 1 row, rank 1 holds 2
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        px.print("hello", r)
    return {
        "printed": printed.getvalue(),
        "mean": px.reduce(torch.tensor([float(r + 1)]), "mean"),
        "sum": px.reduce({"a": torch.tensor([float(r + 1)])}, "sum")["a"],
        "gather": px.gather(torch.tensor([r, r])),
        "gather_scalar": px.gather(torch.tensor(float(r))),
        "gather_ragged": px.gather(ragged),
        "gather_nested": px.gather((torch.tensor([r]), {"k": torch.tensor([10 * r])})),
        "objects": px.gather_for_metrics([f"pred-{r}"]),
        "is_main": px.is_main_process,
        "device": str(px.device),
    }
