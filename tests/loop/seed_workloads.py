"""Run on every rank by the seeding tests: worker RNG streams, model init, a short seeded training."""
from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

from phalanx import Phalanx


class RandomDraws(Dataset):
    """Each item: its index, the worker that loaded it, and one draw from torch, NumPy and `random`."""

    def __init__(self, n: int):
        self.n = n
        self.init_ran = False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return {"index": i, "worker": -1 if info is None else info.id, "init_ran": self.init_ran,
                "torch": torch.rand(1).item(), "numpy": float(np.random.rand()), "random": random.random()}


def mark_init(worker_id: int) -> None:
    """A user's worker_init_fn: phalanx's seeding must not replace it."""
    get_worker_info().dataset.init_ran = True


def streams_and_training(seed: int, epochs: int = 2) -> dict:
    """Per (epoch, worker) the draws of this rank's workers; the model right after seeding; weights
    after a few dropout-using DDP steps."""
    px = Phalanx(seed=seed, strategy="ddp")
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}  # before DDP broadcasts
    loader = DataLoader(RandomDraws(16), batch_size=2, shuffle=True, num_workers=2, worker_init_fn=mark_init)
    loader = px.prepare(loader)
    streams: dict = {}
    for epoch in range(epochs):
        for batch in loader:
            for j, w in enumerate(batch["worker"].tolist()):
                entry = streams.setdefault((epoch, w), {"index": [], "torch": [], "numpy": [], "random": [],
                                                        "init_ran": []})
                for key in entry:
                    value = batch[key][j]
                    entry[key].append(value.item() if isinstance(value, torch.Tensor) else value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    for step in range(4):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8])
        px.backward(loss)
        optimizer.step()
    final = {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}
    return {"rank": px.rank, "streams": streams, "init": init, "final": final}
