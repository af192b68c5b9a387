"""Run on every rank by the seeding tests: worker RNG streams, model init, a short seeded training."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

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
        return {
            "index": i,
            "worker": -1 if info is None else info.id,
            "init_ran": self.init_ran,
            "torch": torch.rand(1).item(),
            "numpy": float(np.random.rand()),
            "random": random.random(),
        }


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
                entry = streams.setdefault(
                    (epoch, w), {"index": [], "torch": [], "numpy": [], "random": [], "init_ran": []}
                )
                for key in entry:
                    value = batch[key][j]
                    entry[key].append(value.item() if isinstance(value, torch.Tensor) else value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    for step in range(4):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[step * 8 : (step + 1) * 8]), y[step * 8 : (step + 1) * 8])
        px.backward(loss)
        optimizer.step()
    final = {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}
    return {"rank": px.rank, "streams": streams, "init": init, "final": final}


class Augmented(Dataset):
    """A fixed sample plus noise drawn in `__getitem__` from torch, NumPy and `random`."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.randn(8) * 0.1 + float(np.random.normal()) * 0.01 + random.gauss(0, 0.01)
        return self.x[i] + noise, self.y[i]


class AugmentedStream(IterableDataset):
    """The same samples as a stream, augmented as it goes."""

    def __init__(self, n: int = 32):
        self.samples = Augmented(n)

    def __iter__(self):
        for i in range(len(self.samples)):
            yield self.samples[i]


def _augmented_run(directory: str, persistent: bool, stop_at: int | None, resume: bool, stream: bool = False) -> tuple:
    """Train 2 epochs of 4 steps on augmented samples with 2 workers per rank; with `stop_at`, save
    after that many steps of epoch 1 and stop; with `resume`, load the save and finish."""
    px = Phalanx(seed=5, strategy="ddp", checkpoint_dir=directory)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if stream:
        loader = DataLoader(AugmentedStream(), batch_size=4, num_workers=2, persistent_workers=persistent)
    else:
        loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    if resume:
        assert px.load_state() is True
    inputs = []
    while loader.epoch < 2:
        epoch = loader.epoch
        for step, (x, y) in enumerate(loader):
            inputs.append(x.clone())
            optimizer.zero_grad()
            px.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            if stop_at is not None and epoch == 1 and step + 1 == stop_at:
                px.save_state()
                return px, model, inputs
    return px, model, inputs


def resume_with_workers(directory: str, persistent: bool, stream: bool = False) -> dict:
    """An uninterrupted run, and the same run saved mid-epoch 1 and resumed in a fresh Phalanx."""
    px, model, straight = _augmented_run(directory + "/unused", persistent, None, False, stream)
    weights = {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}
    _, _, before = _augmented_run(directory, persistent, 2, False, stream)
    px, model, after = _augmented_run(directory, persistent, None, True, stream)
    resumed = {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}
    return {"straight": straight, "before": before, "after": after, "weights": weights, "resumed": resumed}
