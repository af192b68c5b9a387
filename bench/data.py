"""Bytes each rank reads from a sharded corpus, as a fraction of the corpus: split by shard vs item by item.

    python bench/data.py [--shards 16] [--lines 4000]

A corpus of JSON-lines files is read by 2 and 4 ranks x 2 DataLoader workers, each rank's view built as
`prepare` builds it (`stream_for_rank` with that rank's context; no process group needed). Sources:
- sharded_stream: phalanx.data.ShardedStream(files, read): the files are dealt to ranks x workers;
- datasets:       a Hugging Face `datasets` streaming IterableDataset over the same files (if installed):
                  split over ranks by split_dataset_by_node, over workers by itself;
- item_split:     a plain IterableDataset that reads every file: phalanx's fallback keeps 1 item in N.
Bytes are what each reader process read (/proc/self/io rchar) while it iterated. Ideal: 1/ranks per rank,
1.0 for the whole job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from torch.utils.data import DataLoader, IterableDataset

from phalanx.data import ShardedStream
from phalanx.data.streams import stream_for_rank
from phalanx.runtime.context import DistContext

WORKERS = 2


def read_jsonl(path: str):
    with open(path) as f:
        for line in f:
            yield json.loads(line)


class AllFiles(IterableDataset):
    """A stream phalanx cannot split by shard: every file, every line."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __iter__(self):
        for path in self.paths:
            yield from read_jsonl(path)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class Measured(IterableDataset):
    """`dataset`, noting in `log/<pid>` the bytes this reader process read while iterating it."""

    def __init__(self, dataset: IterableDataset, log: str):
        self.dataset, self.log = dataset, log

    def __iter__(self):
        start = rchar()
        yield from self.dataset
        read = rchar() - start
        with open(os.path.join(self.log, str(os.getpid())), "a") as f:
            f.write(f"{read}\n")


def bytes_read(dataset: IterableDataset, rank: int, world: int, folder: str) -> tuple[int, int]:
    """(bytes this rank's readers read, items it got) for one epoch."""
    log = tempfile.mkdtemp(dir=folder)
    view = stream_for_rank(dataset, DistContext(rank=rank, world_size=world), 0, WORKERS)
    items = sum(len(b["i"]) for b in DataLoader(Measured(view, log), batch_size=64, num_workers=WORKERS))
    total = sum(int(x) for path in Path(log).iterdir() for x in path.read_text().split())
    return total, items


def sources(paths: list[str], folder: str) -> dict:
    found = {"sharded_stream": lambda: ShardedStream(paths, read_jsonl), "item_split": lambda: AllFiles(paths)}
    try:
        import datasets
    except ImportError:
        print("datasets is not installed (pip install phalanx[datasets]): its row is left out")
        return found
    found["datasets"] = lambda: datasets.load_dataset(
        "json", data_files=paths, split="train", streaming=True, cache_dir=os.path.join(folder, "hf")
    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--lines", type=int, default=4000, help="lines per shard")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-data-") as folder:
        paths = []
        for s in range(args.shards):
            path = os.path.join(folder, f"shard-{s:03d}.jsonl")
            with open(path, "w") as f:
                for k in range(args.lines):
                    f.write(json.dumps({"i": s * args.lines + k, "text": "lorem ipsum " * 6}) + "\n")
            paths.append(path)
        corpus = sum(os.path.getsize(p) for p in paths)
        num_items = args.shards * args.lines
        print(f"corpus: {args.shards} shards, {num_items} items, {corpus / 1e6:.1f} MB; {WORKERS} workers per rank")
        print(f"{'source':16} {'ranks':>5}  {'bytes read per rank / corpus':34} {'job / corpus':>12}  items")
        for name, make in sources(paths, folder).items():
            for world in (2, 4):
                per_rank = [bytes_read(make(), rank, world, folder) for rank in range(world)]
                fractions = [b / corpus for b, _ in per_rank]
                items = sum(n for _, n in per_rank)
                shown = " ".join(f"{f:.3f}" for f in fractions)
                print(f"{name:16} {world:5}  {shown:34} {sum(fractions):12.2f}  {items}/{num_items}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
