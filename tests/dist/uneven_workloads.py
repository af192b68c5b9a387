"""Rank functions for the lockstep-safety tests: equal step counts, uneven inputs, failures."""

from __future__ import annotations

import itertools
import os
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

from phalanx import Phalanx

SIZES = (1, 7, 101, 1000)
BATCH_SIZES = (1, 4, 32)


class Stream(IterableDataset):
    """0..n-1 as a stream with no __len__: the loader cannot know how many batches a rank gets."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n).unbind(0))


class EveryIndex(Sampler[int]):
    """A user sampler phalanx cannot rebuild index-wise (forces the batch-dealing path)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _loader(kind: str, n: int, batch: int, drop_last: bool) -> DataLoader:
    if kind == "iterable":
        return DataLoader(Stream(n), batch_size=batch, drop_last=drop_last)
    data = TensorDataset(torch.arange(n))
    if kind == "sampler":
        return DataLoader(data, batch_size=batch, sampler=EveryIndex(n), drop_last=drop_last)
    return DataLoader(data, batch_size=batch, shuffle=True, drop_last=drop_last)


def _first(batch):
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def size_matrix(kinds: tuple[str, ...] = ("map", "sampler", "iterable")) -> dict:
    """Every size x batch size x drop_last x loader kind in one launch; ddp-train on the 'map' kind."""
    px = Phalanx(strategy="ddp")
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = px.prepare(model, optimizer)
    out = {}
    for kind, n, batch, drop_last in itertools.product(kinds, SIZES, BATCH_SIZES, (False, True)):
        loader = px.prepare(_loader(kind, n, batch, drop_last))
        seen, gathered, steps = [], [], 0
        for b in loader:
            idx = _first(b)
            seen += idx.tolist()
            gathered += px.gather_for_metrics(idx).tolist()
            if kind == "map":
                optimizer.zero_grad()
                loss = model(idx.float().unsqueeze(1) / 1000).pow(2).mean()
                px.backward(loss)
                optimizer.step()
            steps += 1
        length = len(loader) if kind != "iterable" else None
        out[(kind, n, batch, drop_last)] = {"steps": steps, "len": length, "seen": seen, "gathered": gathered}
    out["params"] = [p.detach().clone() for p in px.unwrap_model(model).parameters()]
    return out


def iterable_workers(n: int, batch: int, num_workers: int) -> dict:
    """An IterableDataset read by several DataLoader workers on every rank."""
    px = Phalanx()
    loader = px.prepare(DataLoader(Stream(n), batch_size=batch, num_workers=num_workers))
    seen, gathered = [], []
    for idx in loader:
        seen += idx.tolist()
        gathered += px.gather_for_metrics(idx).tolist()
    return {"seen": seen, "gathered": gathered}


def _rank_items(rank: int, num_batches: int, batch: int) -> TensorDataset:
    """Pre-split data: rank r owns ids r*1000 + i, so every item is unique across ranks."""
    ids = torch.arange(num_batches * batch) + 1000 * rank
    return TensorDataset(ids, torch.randn(len(ids), 3, generator=torch.Generator().manual_seed(rank)))


def presplit_suite(strategy: str) -> dict:
    """presplit_train with padding, with drop_last, and prepared with shard=True (the warning)."""
    px = Phalanx(strategy=strategy)
    return {
        "pad": presplit_train(px, False),
        "drop": presplit_train(px, True),
        "resharded": presplit_train(px, False, shard=True),
    }


def presplit_train(px: Phalanx, drop_last: bool, shard: bool = False) -> dict:
    """Rank 0 holds 5 batches, rank 1 holds 4; prepared (shard=False by default) and trained."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)
    batch = 4
    data = _rank_items(px.rank, 5 - px.rank, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = px.prepare(DataLoader(data, batch_size=batch, drop_last=drop_last), shard=shard)
    steps, gathered = 0, []
    for ids, x in loader:
        optimizer.zero_grad()
        px.backward(model(x).pow(2).mean())
        optimizer.step()
        gathered += px.gather_for_metrics(ids).tolist()
        steps += 1
    params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return {
        "steps": steps,
        "len": len(loader),
        "gathered": gathered,
        "params": params,
        "warnings": [str(w.message) for w in caught if "phalanx" in str(w.message)],
    }


def user_loop_suite(strategy: str, methods: tuple[str, ...]) -> dict:
    px = Phalanx(strategy=strategy)
    out = {method: user_loop_uneven(px, method) for method in methods}
    if "join" in methods:  # the docs' pattern: only the model named; zero1's optimizer joins too
        out["model_only"] = user_loop_uneven(px, "auto", model_only=True)
    try:
        px.join()  # every prepared model and optimizer
        out["join_error"] = None
    except ValueError as error:
        out["join_error"] = str(error)
    return out


def user_loop_uneven(px: Phalanx, method: str, model_only: bool = False) -> dict:
    """A user loop over a plain list whose length depends on the rank, inside px.uneven_inputs."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)
    g = torch.Generator().manual_seed(px.rank)
    batches = [torch.randn(4, 3, generator=g) for _ in range(5 - px.rank)]
    steps = rows = 0
    with px.uneven_inputs(*((model,) if model_only else (model, optimizer)), method=method) as uneven:
        for x in uneven.iter(batches):
            optimizer.zero_grad()
            px.backward(model(x).pow(2).mean())
            optimizer.step()
            steps, rows = steps + 1, rows + len(x)
    px.wait_for_everyone()
    params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return {"steps": steps, "rows": rows, "method": uneven.method, "params": params}


def env_flag(name: str) -> str | None:
    return os.environ.get(name)
