"""IterableDataset sharding over ranks and DataLoader workers: each item goes to exactly one reader.

What phalanx does with an IterableDataset (docs/data.md):
- one that shards itself by rank (its `__iter__` reads the rank or the world size, from torch.distributed
  or the environment) is used as it is: sharding it again would keep 1/N of each reader's part;
- one that splits itself over DataLoader workers only (torch's docs' example: `get_worker_info()` in
  `__iter__`) is split by rank on top (`ShardedIterable(..., by_worker=False)`): each rank's workers
  read their parts and the rank keeps 1 item in N of each, so the job reads each item once;
- a `ShardedStream` or a Hugging Face `datasets` IterableDataset is split by shard (data/streaming.py);
- any other is split item by item (`ShardedIterable`), every reader walking the stream under one
  seed per epoch shared by all readers, so a stream that shuffles inside `__iter__` walks the same
  permutation everywhere and the split stays a partition. Phalanx says once that it did so and how to
  choose otherwise (`shard=False`).
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from phalanx.runtime.seeding import cpu_rng_states, seed_cpu_rngs, set_cpu_rng_states, shared_seed

_STREAM = 0x57EA  # keeps a stream's per-epoch seed apart from other per-epoch seeds
# Names a self-sharding __iter__ reads: the rank (from torch.distributed or the environment), or only the
# worker info (torch's docs' example splits over DataLoader workers, not over ranks).
_RANK_NAMES = frozenset({"get_rank", "get_world_size"})
_RANK_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK"})
_WORKER_NAMES = frozenset({"get_worker_info"})
_warned: set[type] = set()


def shards_itself(dataset: IterableDataset) -> bool:
    """Whether the dataset's own `__iter__` (or a function defined in it) reads the rank: it is this
    rank's part already."""
    code = getattr(type(dataset).__iter__, "__code__", None)
    return code is not None and _reads(code, _RANK_NAMES, _RANK_ENV)


def splits_over_workers(dataset: IterableDataset) -> bool:
    """Whether the dataset's own `__iter__` reads the worker info (it splits itself over a DataLoader's
    workers, each reading its part); split by rank or not, see `shards_itself`."""
    code = getattr(type(dataset).__iter__, "__code__", None)
    return code is not None and _reads(code, _WORKER_NAMES, frozenset())


def _reads(code: types.CodeType, names: frozenset[str], env: frozenset[str]) -> bool:
    if names & set(code.co_names) or env & {c for c in code.co_consts if isinstance(c, str)}:
        return True
    return any(_reads(c, names, env) for c in code.co_consts if isinstance(c, types.CodeType))


def say_once(what: type, message: str) -> None:
    """Warn with `message` the first time only, per kind of dataset (`what`) and process."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(message, stacklevel=7)  # the script line that called prepare_data_loader


def say_item_split(dataset: IterableDataset, readers: int, by_worker: bool = True) -> None:
    """Once per dataset class: phalanx split this stream item by item, and how to choose otherwise."""
    if not by_worker and readers > 1:  # its workers read their parts, each rank all of them
        say_once(
            type(dataset),
            (
                f"phalanx: {type(dataset).__name__} splits itself over DataLoader workers (get_worker_info) but not "
                f"over ranks, so phalanx splits it item by item over the {readers} data-parallel ranks: each rank "
                f"reads the whole stream (over its workers, if any) and keeps 1 item in {readers}. HINT: to read each item once "
                "in the job, split it by rank too in __iter__ (torch.distributed.get_rank()) and prepare it with "
                "shard=False, or give it to phalanx.data.ShardedStream(shards, read)"
            ),
        )
    elif readers > 1:
        say_once(
            type(dataset),
            (
                f"phalanx: {type(dataset).__name__} is an IterableDataset that phalanx cannot split by shard, so it is "
                f"split item by item: each of the {readers} readers (ranks x workers) reads the whole stream and keeps "
                f"1 item in {readers}. HINT: if it shards itself by rank and worker, prepare it with shard=False; if it "
                "reads files or shards, give it to phalanx.data.ShardedStream(shards, read) so each is read once"
            ),
        )


class ShardedIterable(IterableDataset):
    """Item i of the stream goes to reader i % (world_size * num_workers), readers ordered rank-major;
    with `by_worker=False` (a stream that splits itself over workers), item i of each worker's part goes
    to rank i % world_size, so worker w of every rank walks the same part.

    Every reader walks the whole stream and keeps its own items, so no item is seen twice and none
    is lost, provided every reader walks the same sequence: each pass runs under one seed per epoch
    shared by all readers (random, NumPy and torch), so a dataset that shuffles its files or items
    in `__iter__` walks the same permutation on every reader. Without workers, a rank is one reader,
    and the seeded streams are swapped in only while the dataset runs (the model's stay its own).
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, seed: int = 0, by_worker: bool = True):
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.by_worker = by_worker
        self.epoch = 0  # set by the prepared loader each pass; persistent workers count passes themselves

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def reader(self) -> tuple[int, int]:
        """(this reader's index, number of readers) in the current process."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None and self.by_worker else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[Any]:
        mine, readers = self.reader()
        epoch = self.epoch
        self.epoch += 1  # a persistent worker's copy is iterated once per pass
        rngs = _StreamRngs(shared_seed(self.seed, epoch, _STREAM), own_process=get_worker_info() is not None)
        items = rngs.run(lambda: iter(self.dataset))
        index = 0
        while True:
            item = rngs.run(lambda: next(items, _END))
            if item is _END:
                return
            if index % readers == mine:
                yield item
            index += 1

    def __getattr__(self, name: str) -> Any:
        # Attributes of the user's dataset (vocab, features...) stay reachable through the wrapper.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


_END = object()


class _StreamRngs:
    """The global RNG streams a stream's `__iter__` draws from, seeded alike on every reader.

    In a worker process they are the worker's own: seeded once. In the main process they belong to
    the model: the stream's states are swapped in around each call into the dataset and out after.
    """

    def __init__(self, value: int, own_process: bool):
        self.own_process = own_process
        saved = cpu_rng_states()
        seed_cpu_rngs(value)
        self.states = None if own_process else cpu_rng_states()
        if not own_process:
            set_cpu_rng_states(saved)

    def run(self, call: Any) -> Any:
        if self.own_process:
            return call()
        outer = cpu_rng_states()
        set_cpu_rng_states(self.states)
        try:
            return call()
        finally:
            self.states = cpu_rng_states()
            set_cpu_rng_states(outer)
