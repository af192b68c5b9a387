"""Rank functions for test_data_kinds.py: every loader kind of issue #30 through the facade, in one launch.

Each case records, per epoch, the items this rank read and, per step, the items
`gather_for_metrics` returns (all data-parallel ranks' real items of that step, padding cut).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler

from phalanx import Phalanx
from phalanx.data import ShardedStream
from tests.data_counts import CountingReader, SelfSharding, ShufflingFiles, ids

N = 40
SEED = 3
EPOCHS = 2


def sampler_loader(kind: str, batch: int) -> DataLoader:
    """The map-style cases, also built by the test for its one-process reference."""
    data = TensorDataset(torch.arange(N))
    if kind == "weighted":
        sampler = WeightedRandomSampler(torch.linspace(0.1, 1.0, N), N)
    else:  # "replacement"
        sampler = RandomSampler(data, replacement=True, num_samples=20, generator=torch.Generator().manual_seed(5))
    return DataLoader(data, batch_size=batch, sampler=sampler)


def _stream_loaders(shards: list[str], log: str) -> dict[str, DataLoader]:
    loaders = {
        "shuffling": DataLoader(ShufflingFiles(N), batch_size=4, num_workers=2),
        "sharded_stream": DataLoader(
            ShardedStream(shards, CountingReader(log), shuffle=True), batch_size=4, num_workers=2
        ),
    }
    try:
        import datasets
    except ImportError:
        return loaders
    hf = datasets.load_dataset(
        "json", data_files=shards, split="train", streaming=True, cache_dir=log + "-hf"
    ).select_columns(["i"])
    loaders["hf_datasets"] = DataLoader(hf, batch_size=4, num_workers=2)
    return loaders


def _epochs(px: Phalanx, loader) -> dict:
    read, steps = [], []
    for _ in range(EPOCHS):
        mine = []
        for batch in loader:
            mine += ids(batch)
            steps.append(sorted(px.gather_for_metrics(torch.tensor(ids(batch))).tolist()))
        read.append(mine)
    return {"read": read, "steps": steps}


def data_suite(tp: int, shards: list[str], log: str) -> dict:
    warnings.simplefilter("ignore")
    px = Phalanx(strategy="ddp", tp=tp, seed=SEED) if tp > 1 else Phalanx(strategy="ddp", seed=SEED)
    out: dict = {"dp_rank": px.dp_rank, "dp_size": px.dp_size}
    loaders = _stream_loaders(shards, log)
    for kind in ("weighted", "replacement"):
        loaders[kind] = sampler_loader(kind, 4)
    if tp == 1:  # it reads the global rank, which tp ranks do not share
        loaders["self_sharding"] = DataLoader(SelfSharding(N), batch_size=4, num_workers=2)
    for name, loader in loaders.items():
        out[name] = _epochs(px, px.prepare(loader))
    out["nested"] = _nested(px)
    out["zip"] = _zipped(px)
    out["resume"] = _resume(px, os.path.dirname(log))
    rank_seeded = RandomSampler(range(N), generator=torch.Generator().manual_seed(1000 + px.rank))
    try:
        px.prepare(DataLoader(TensorDataset(torch.arange(N)), batch_size=4, sampler=rank_seeded))
    except ValueError as error:
        out["rank_seeded"] = str(error)
    return out


def _resume(px: Phalanx, folder: str) -> dict:
    """Through save_state/load_state: a random sampler's epoch continued (not redrawn), an epoch left early
    resumed at the next one, a StatefulDataLoader saved on its epoch's last batch going on with the next."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    weighted = px.prepare(
        DataLoader(
            TensorDataset(torch.arange(N)),
            batch_size=4,
            sampler=WeightedRandomSampler(torch.linspace(0.1, 1.0, N), N, generator=torch.Generator().manual_seed(9)),
        )
    )
    it = iter(weighted)
    done = [ids(next(it)) for _ in range(3)]
    px.save_state(os.path.join(folder, "weighted"))
    rest = [ids(b) for b in it]
    del it
    px.load_state(os.path.join(folder, "weighted"))
    again = [ids(b) for b in weighted]

    left = px.prepare(DataLoader(TensorDataset(torch.arange(N)), batch_size=4, shuffle=True))
    for step, _ in enumerate(left):
        if step == 2:
            break
    px.save_state(os.path.join(folder, "left"))
    next_epoch = [ids(b) for b in left]
    px.load_state(os.path.join(folder, "left"))
    after_left = [ids(b) for b in left]

    stateful = px.prepare(StatefulDataLoader(TensorDataset(torch.arange(N)), batch_size=4, shuffle=True))
    it = iter(stateful)
    for _ in range(len(stateful)):  # the epoch's last batch, the loop not yet left
        next(it)
    px.save_state(os.path.join(folder, "stateful"))
    del it
    px.load_state(os.path.join(folder, "stateful"))
    epochs = [[i for b in stateful for i in ids(b)] for _ in range(2)]
    return {
        "done": done,
        "rest": rest,
        "again": again,
        "next_epoch": next_epoch,
        "after_left": after_left,
        "stateful_epochs": epochs,
    }


def _nested(px: Phalanx) -> dict:
    """An eval loop inside the training loop: each loop's gather_for_metrics counts its own items."""
    train = px.prepare(DataLoader(TensorDataset(torch.arange(37)), batch_size=4, shuffle=True))
    evals = px.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=5))
    trained, evaluated = [], []
    for _ in range(EPOCHS):
        for batch in train:
            for eval_batch in evals:
                evaluated += px.gather_for_metrics(eval_batch[0]).tolist()
            trained += px.gather_for_metrics(batch[0]).tolist()
    return {"trained": trained, "evaluated": evaluated}


def _zipped(px: Phalanx) -> dict:
    """Two loaders read side by side: each gather names the loader its data came from."""
    a = px.prepare(DataLoader(TensorDataset(torch.arange(37)), batch_size=4))
    b = px.prepare(DataLoader(TensorDataset(torch.arange(100, 117)), batch_size=2))
    got_a, got_b = [], []
    for batch_a, batch_b in zip(a, b):
        got_a += px.gather_for_metrics(batch_a[0], loader=a).tolist()
        got_b += px.gather_for_metrics(batch_b[0], loader=b).tolist()
    return {"a": got_a, "b": got_b}
