"""Counting what readers saw, for the data tests: index-carrying datasets, counted per epoch."""

from __future__ import annotations

import collections
from typing import Any, Iterable

import torch
from torch.utils.data import IterableDataset, get_worker_info


def counts(items: Iterable[int], n: int) -> dict[str, int]:
    """total / distinct / duplicated / missing of `items` against 0..n-1."""
    items = [int(i) for i in items]
    seen = collections.Counter(items)
    return {
        "total": len(items),
        "distinct": len(seen),
        "duplicated": sum(c - 1 for c in seen.values() if c > 1),
        "missing": n - len(set(seen) & set(range(n))),
    }


def exact(n: int) -> dict[str, int]:
    """Every item of 0..n-1 once."""
    return {"total": n, "distinct": n, "duplicated": 0, "missing": 0}


def ids(batch: Any) -> list[int]:
    """The item indices in a batch of an index-carrying dataset (tensor, tuple of tensors, or dict)."""
    if isinstance(batch, dict):
        batch = batch["i"]
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return [int(i) for i in torch.as_tensor(batch).flatten().tolist()]


class SelfSharding(IterableDataset):
    """0..n-1, split by the dataset itself over ranks and workers, as torch's docs teach."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        import torch.distributed as dist

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return iter(range(rank * workers + worker, self.n, world * workers))


class WorkerSplit(IterableDataset):
    """start..end-1 (each index as `item(i)`), split over DataLoader workers as torch.utils.data's docs
    (example 1) write it; not by rank."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def item(self, index: int) -> Any:
        return index

    def __iter__(self):
        import math

        worker_info = get_worker_info()
        if worker_info is None:  # single-process data loading, return the full iterator
            iter_start, iter_end = self.start, self.end
        else:  # in a worker process: split workload
            per_worker = int(math.ceil((self.end - self.start) / float(worker_info.num_workers)))
            iter_start = self.start + worker_info.id * per_worker
            iter_end = min(iter_start + per_worker, self.end)
        return iter(self.item(i) for i in range(iter_start, iter_end))


class ShufflingFiles(IterableDataset):
    """0..n-1 as `files` "files" of consecutive items, the file list shuffled inside each pass."""

    def __init__(self, n: int, files: int = 8):
        self.n, self.files = n, files

    def __iter__(self):
        import random

        per = self.n // self.files
        order = list(range(self.files))
        random.shuffle(order)
        for f in order:
            yield from range(f * per, (f + 1) * per)


def write_jsonl_shards(folder, n: int, num_shards: int) -> list[str]:
    """0..n-1 as JSON lines {"i": index, "pad": "..."} over `num_shards` files; their paths."""
    import json
    import os

    paths = []
    for s in range(num_shards):
        path = os.path.join(str(folder), f"shard-{s:03d}.jsonl")
        with open(path, "w") as f:
            for i in range(s, n, num_shards):
                f.write(json.dumps({"i": i, "pad": "x" * 40}) + "\n")
        paths.append(path)
    return paths


class CountingReader:
    """`read` for a ShardedStream over JSON-lines files: yields each line's {"i": ...}, and notes the
    bytes this process read in `log_folder/<pid>` (workers are processes)."""

    def __init__(self, log_folder: str):
        self.log_folder = log_folder

    def __call__(self, path: str):
        import json
        import os

        with open(path, "rb") as f:
            data = f.read()
        with open(os.path.join(self.log_folder, str(os.getpid())), "a") as log:
            log.write(f"{len(data)}\n")
        for line in data.splitlines():
            yield {"i": json.loads(line)["i"]}


def bytes_logged(log_folder: str) -> int:
    from pathlib import Path

    return sum(int(x) for path in Path(log_folder).iterdir() for x in path.read_text().split())
