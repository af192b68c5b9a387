"""IterableDataset sharding over ranks and DataLoader workers: each item goes to exactly one reader."""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info


class ShardedIterable(IterableDataset):
    """Item i of the stream goes to reader i % (world_size * num_workers), readers ordered rank-major.

    Every reader walks the whole stream and keeps its own items, so no item is seen twice and none
    is lost, whatever the dataset does; a dataset that can seek should shard itself and be
    prepared with `shard=False`. Without workers, a rank is one reader.
    """

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int):
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size

    def reader(self) -> tuple[int, int]:
        """(this reader's index, number of readers) in the current process."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[Any]:
        mine, readers = self.reader()
        for index, item in enumerate(self.dataset):
            if index % readers == mine:
                yield item

    def __getattr__(self, name: str) -> Any:
        # Attributes of the user's dataset (vocab, features...) stay reachable through the wrapper.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
