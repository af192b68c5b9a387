"""IterableDataset sharding over ranks and DataLoader workers: each item goes to exactly one reader.

What phalanx does with an IterableDataset (docs/data.md):
- one that shards itself (its `__iter__` reads `get_worker_info`, the rank or the world size) is used
  as it is: sharding it again would keep 1/N of each reader's part;
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
# Names a self-sharding __iter__ reads (torch's docs teach get_worker_info; rank from torch.distributed
# or the environment).
_SHARDING_NAMES = frozenset({"get_worker_info", "get_rank", "get_world_size"})
_SHARDING_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK"})
_warned: set[type] = set()


def shards_itself(dataset: IterableDataset) -> bool:
    """Whether the dataset's own `__iter__` (or a function defined in it) reads the worker info or the rank."""
    code = getattr(type(dataset).__iter__, "__code__", None)
    return code is not None and _reads_sharding(code)


def _reads_sharding(code: types.CodeType) -> bool:
    if _SHARDING_NAMES & set(code.co_names) or _SHARDING_ENV & {c for c in code.co_consts if isinstance(c, str)}:
        return True
    return any(_reads_sharding(c) for c in code.co_consts if isinstance(c, types.CodeType))


def say_once(what: type, message: str) -> None:
    """Warn with `message` the first time only, per kind of dataset (`what`) and process."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(message, stacklevel=7)  # the script line that called prepare_data_loader


def say_item_split(dataset: IterableDataset, readers: int) -> None:
    """Once per dataset class: phalanx split this stream item by item, and how to choose otherwise."""
    if readers > 1:
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
    """Item i of the stream goes to reader i % (world_size * num_workers), readers ordered rank-major.

    Every reader walks the whole stream and keeps its own items, so no item is seen twice and none
    is lost, provided every reader walks the same sequence: each pass runs under one seed per epoch
    shared by all readers (random, NumPy and torch), so a dataset that shuffles its files or items
    in `__iter__` walks the same permutation on every reader. Without workers, a rank is one reader,
    and the seeded streams are swapped in only while the dataset runs (the model's stay its own).
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, seed: int = 0):
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0  # set by the prepared loader each pass; persistent workers count passes themselves

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def reader(self) -> tuple[int, int]:
        """(this reader's index, number of readers) in the current process."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
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
