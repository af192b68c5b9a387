"""Streams split by shard: each file or shard is read by one reader of the whole job, not by all of them.

Splitting a stream item by item (data/iterable.py) makes every reader read everything and keep 1/N:
at 64 ranks x 8 workers a corpus is read 512 times. A source that comes in shards is split by shard
across ranks and workers instead:
- `ShardedStream(shards, read)`: a list of shards (file paths, URLs, anything `read` opens) and the
  function that yields a shard's items. Reader i of R (rank-major over ranks x workers) reads shards
  i, i+R, ...; with fewer shards than readers, the readers sharing a shard split its items (the
  fallback: that shard is read by each of them).
- `tar_samples(path)`: the items of a webdataset-style tar shard (files grouped by key:
  `000.jpg`, `000.cls` -> {"__key__": "000", "jpg": b"...", "cls": b"..."}), for `read`.
- a Hugging Face `datasets` IterableDataset (from local JSON/Parquet files): split over the ranks by
  `split_dataset_by_node` (its shards when there are at least as many as ranks), then over the workers
  by the dataset itself.
Shards may hold different numbers of items: the prepared loader's per-step agreement evens the ranks.
"""

from __future__ import annotations

import math
import random
import tarfile
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from phalanx.data.iterable import say_once
from phalanx.runtime.seeding import shared_seed

_SHARDS = 0x5A4D  # keeps the shard order's per-epoch seed apart from other per-epoch seeds


class ShardedStream(IterableDataset):
    """Items of `shards`, read by `read(shard)`; each shard read by one reader of the job (see module doc).

    `shuffle=True` reorders the shards each epoch, alike on every reader (seed from the prepared
    loader's seed and the epoch), before they are dealt. Outside phalanx (a plain DataLoader) the
    process is the only rank and its workers share the shards out.
    """

    def __init__(self, shards: Sequence[Any], read: Callable[[Any], Iterable[Any]], *, shuffle: bool = False):
        if not shards:
            raise ValueError("ShardedStream needs at least one shard. HINT: pass the list of files to read")
        self.shards = list(shards)
        self.read = read
        self.shuffle = shuffle
        self.rank, self.world_size, self.seed, self.epoch = 0, 1, 0, 0

    def for_ranks(self, rank: int, world_size: int, seed: int) -> "ShardedStream":
        """This stream as data-parallel rank `rank` of `world_size` reads it (a copy; the user's is unchanged)."""
        twin = ShardedStream(self.shards, self.read, shuffle=self.shuffle)
        twin.rank, twin.world_size, twin.seed = rank, world_size, seed
        return twin

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def assigned(self, reader: int, readers: int, epoch: int = 0) -> list[tuple[Any, int, int]]:
        """(shard, keep every k-th item, offset) for `reader` of `readers` in `epoch`."""
        shards = list(self.shards)
        if self.shuffle:
            random.Random(shared_seed(self.seed, epoch, _SHARDS)).shuffle(shards)
        n = len(shards)
        if n >= readers:
            return [(shard, 1, 0) for shard in shards[reader::readers]]
        # Fewer shards than readers: reader r shares shard r % n with the readers of the same remainder.
        sharing = math.ceil((readers - reader % n) / n)
        return [(shards[reader % n], sharing, reader // n)]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch = self.epoch
        self.epoch += 1  # a persistent worker's copy is iterated once per pass
        for shard, every, offset in self.assigned(self.rank * workers + worker, self.world_size * workers, epoch):
            for index, item in enumerate(self.read(shard)):
                if index % every == offset:
                    yield item

    def __len__(self) -> int:
        raise TypeError("a ShardedStream's length is unknown until its shards are read")


def tar_samples(path: str) -> Iterator[dict[str, Any]]:
    """The samples of a webdataset-style tar: consecutive members with the same key (the name up to its
    first dot) form one sample, `{"__key__": key, extension: bytes, ...}`."""
    sample: dict[str, Any] = {}
    with tarfile.open(path) as archive:
        for member in archive:
            if not member.isfile():
                continue
            name = member.name.rsplit("/", 1)[-1]
            key, _, ext = name.partition(".")
            if sample and key != sample["__key__"]:
                yield sample
                sample = {}
            sample["__key__"] = key
            sample[ext] = archive.extractfile(member).read()  # type: ignore[union-attr]
    if sample:
        yield sample


def is_hf_iterable(dataset: Any) -> bool:
    """A Hugging Face `datasets` IterableDataset (it splits itself over workers; phalanx splits it over ranks)."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "n_shards")


def split_by_script(dataset: Any, rank: int, world_size: int) -> bool:
    """Whether the script already split this `datasets` stream with `split_dataset_by_node` (datasets keeps
    the split in `_distributed`): it is then this rank's part, used as it is (splitting it again keeps
    1/world_size of it, or raises datasets' own error). A split for other ranks than the data-parallel
    ones is refused: it would read another rank's part, or lose data."""
    split = getattr(dataset, "_distributed", None)
    if split is None:
        return False
    if (split.rank, split.world_size) != (rank, world_size):
        raise ValueError(
            f"phalanx: this datasets IterableDataset was split by split_dataset_by_node for rank {split.rank} of "
            f"{split.world_size}, but it is read by data-parallel rank {rank} of {world_size}. HINT: split it with "
            "split_dataset_by_node(ds, rank=px.dp_rank, world_size=px.dp_size), or give phalanx the unsplit "
            "stream and it splits it by shard"
        )
    return True


def split_hf_iterable(dataset: Any, rank: int, world_size: int) -> Any:
    """`dataset` for data-parallel `rank`: whole shards when it has at least one per rank, else every
    world_size-th example (each rank then reads every shard; said once)."""
    from datasets.distributed import split_dataset_by_node

    if world_size == 1:
        return dataset
    if dataset.n_shards >= world_size:
        return split_dataset_by_node(dataset, rank=rank, world_size=world_size, strategy="shards")
    say_once(
        type(dataset),
        (
            f"phalanx: this datasets IterableDataset has {dataset.n_shards} shards for {world_size} data-parallel ranks, "
            f"so each rank reads every shard and keeps 1 example in {world_size}. HINT: give it at least {world_size} "
            "shards (more files, or Dataset.to_iterable_dataset(num_shards=...)) so each is read once"
        ),
    )
    return split_dataset_by_node(dataset, rank=rank, world_size=world_size, strategy="examples")
