"""Rank functions for test_data_idioms.py (issue 40): loops written as torch's docs write them, on 2 ranks.

- the short last batch of an epoch (drop_last=False): a map-style dataset of 19 and a stream of 17, global
  batch 8, with a mean loss and with a summed loss + num_items: grad norms per step and final weights;
- `datasets` streams the script split itself with `split_dataset_by_node`: the items each rank reads.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from phalanx import Phalanx

GLOBAL_BATCH = 8
EPOCHS = 2
LR = 0.1


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


class Stream(IterableDataset):
    """(x, y) pairs of `data(n)`, in order: a stream with no length."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        x, y = data(self.n)
        return iter(zip(x, y))


def loader_of(kind: str, batch: int) -> DataLoader:
    """kind: "map" (19 items) or "stream" (17 items), with torch's default drop_last=False."""
    if kind == "map":
        return DataLoader(TensorDataset(*data(19)), batch_size=batch)
    return DataLoader(Stream(17), batch_size=batch)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(5)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, summed: bool) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y, reduction="sum" if summed else "mean")


def one_process(kind: str, summed: bool) -> dict:
    """The reference: the same loop in one process, no phalanx."""
    model, optimizer = model_and_optimizer()
    norms, losses = [], []
    for _ in range(EPOCHS):
        for x, y in loader_of(kind, GLOBAL_BATCH):
            optimizer.zero_grad()
            loss = loss_of(model, x, y, summed)
            loss = loss / y.numel() if summed else loss
            loss.backward()
            losses.append(float(loss))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
            optimizer.step()
    return {"norms": norms, "losses": losses, "weights": [p.detach().clone() for p in model.parameters()]}


def _train(px: Phalanx, kind: str, summed: bool) -> dict:
    # One launch for both loss kinds: a run passes num_items on every backward or on none, agreed at its
    # first backward, so each case starts that agreement over (a test shortcut, not a script's).
    px._items.used = None
    model, optimizer = model_and_optimizer()
    model, optimizer = px.prepare(model, optimizer)
    loader = px.prepare(loader_of(kind, GLOBAL_BATCH // px.dp_size))
    norms, losses = [], []
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_of(model, x, y, summed)
            px.backward(loss, num_items=y.numel() if summed else None)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))  # after num_items' rescale
            optimizer.step()
            losses.append(px.step_loss if summed else None)
    model.eval()  # an eval pass: every rank's batches keep one shape (a script's own all_gather), repeats dropped by
    shapes, gathered = [], 0  # gather_for_metrics
    for x, _ in loader:
        shapes.append(int(x.shape[0]))
        gathered += int(px.gather_for_metrics(x).shape[0])
    return {
        "norms": norms,
        "losses": losses,
        "eval_shapes": shapes,
        "eval_gathered": gathered,
        "weights": [p.detach().clone() for p in px.unwrap_model(model).parameters()],
    }


def _presplit(px: Phalanx, shards: list[str], strategy: str, cache: str) -> dict:
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset("json", data_files=shards, split="train", streaming=True, cache_dir=cache)
    mine = split_dataset_by_node(stream, rank=px.dp_rank, world_size=px.dp_size, strategy=strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = px.prepare(DataLoader(mine.select_columns(["i"]), batch_size=4))
    read = [[int(i) for batch in loader for i in batch["i"]] for _ in range(EPOCHS)]
    return {"read": read, "said": [str(w.message) for w in caught if "phalanx" in str(w.message)]}


def suite(shard_sets: dict[str, list[str]], cache: str) -> dict:
    px = Phalanx(strategy="ddp", seed=3)
    out: dict = {"dp_rank": px.dp_rank}
    for kind in ("map", "stream"):
        for summed in (False, True):
            out[f"{kind}-{'sum' if summed else 'mean'}"] = _train(px, kind, summed)
    for strategy, shards in shard_sets.items():
        try:  # kept per case, so one refusal does not hide the other checks' figures
            out[f"presplit-{strategy}"] = _presplit(px, shards, strategy, f"{cache}-{strategy}")
        except ValueError as error:
            out[f"presplit-{strategy}"] = {"error": str(error)}
    return out
