"""A small conv net with BatchNorm2d and BatchNorm1d, trained with and without `sync_batchnorm` on
every rank, and the one-process reference on the global batch (run in-process by the test)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx
from phalanx.model.sync_batchnorm import CPUSyncBatchNorm, unsynced_batchnorms

STEPS, PER_RANK = 3, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 3),
    )


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 2 * PER_RANK, 2, 6, 6, generator=g) * 2 + 1
    return TensorDataset(x, torch.randint(0, 3, (len(x),), generator=g))


def reference(batch_size: int = 2 * PER_RANK) -> dict:
    """One process, batches of `batch_size` (2 ranks' worth by default)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for x, y in DataLoader(make_data(), batch_size=batch_size):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy: str, sync_batchnorm: bool) -> dict:
    px = Phalanx(strategy=strategy, sync_batchnorm=sync_batchnorm, seed=0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    loader = DataLoader(make_data(), batch_size=PER_RANK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, loader = px.prepare(model, optimizer, loader)
    said = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    inner = px.unwrap_model(model)
    kinds = {
        "synced": sum(isinstance(m, CPUSyncBatchNorm) for m in inner.modules()),
        "unsynced": unsynced_batchnorms(inner),
    }
    for x, y in loader:
        px.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    state = px.get_state_dict(model)
    return {"state": {k: v.detach().clone() for k, v in state.items()}, "kinds": kinds, "warned": said}


def matrix(cases: dict[str, dict]) -> dict:
    return {name: train(**kwargs) for name, kwargs in cases.items()}
