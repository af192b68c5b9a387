"""IterableDatasets as each rank of a job reads them (issue #30): self-sharding streams left alone, streams
that shuffle inside __iter__ partitioned, sources with shards split by shard (each byte read once).

Each rank's view is built in this process from an explicit context (`stream_for_rank`), read by real
DataLoader workers; the ranks' per-step agreement is tested on real ranks in test_data_kinds.py.
"""

import os
import tarfile
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from phalanx.data import iterable
from phalanx.data.loader import PreparedLoader
from phalanx.data.streaming import ShardedStream, tar_samples
from phalanx.data.streams import stream_for_rank
from phalanx.runtime.context import DistContext
from tests.data_counts import (
    CountingReader,
    SelfSharding,
    ShufflingFiles,
    WorkerSplit,
    bytes_logged,
    counts,
    exact,
    ids,
    write_jsonl_shards,
)

N = 40


def job_items(dataset, world: int, workers: int, epoch: int = 0) -> list[int]:
    """Every item all ranks x workers read in one epoch of `dataset`, as phalanx splits it."""
    out = []
    for rank in range(world):
        mine = stream_for_rank(dataset, DistContext(rank=rank, world_size=world), 7, workers)
        assert mine is not None
        if hasattr(mine, "set_epoch"):
            mine.set_epoch(epoch)
        out += [i for b in DataLoader(mine, batch_size=4, num_workers=workers) for i in ids(b)]
    return out


@pytest.mark.timeout(120)
def test_a_stream_that_shards_itself_is_not_sharded_again():
    """One process, 2 workers: 40 of 40 per epoch (it was 20: phalanx split each worker's half again)."""
    loader = PreparedLoader(DataLoader(SelfSharding(N), batch_size=4, num_workers=2), DistContext(), seed=1)
    assert [counts([i for b in loader for i in ids(b)], N) for _ in range(2)] == [exact(N)] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,workers", [(2, 0), (2, 2), (4, 3)])
def test_a_stream_split_over_workers_only_is_split_by_rank_too(world, workers):
    """torch's docs' get_worker_info() example: each item once in the job, each rank the steps one process
    takes over its share (it was read whole by every rank: 80 of 40 on 2 ranks, 10 steps for 5)."""
    items = job_items(WorkerSplit(0, N), world, workers)
    assert counts(items, N) == exact(N)
    one_process = len(list(DataLoader(WorkerSplit(0, N), batch_size=4 * world, num_workers=workers)))
    ranks = [
        stream_for_rank(WorkerSplit(0, N), DistContext(rank=r, world_size=world), 7, workers) for r in range(world)
    ]
    assert [len(list(DataLoader(r, batch_size=4, num_workers=workers))) for r in ranks] == [one_process] * world


def test_a_worker_split_stream_split_by_rank_is_said_once_with_the_choice(monkeypatch):
    monkeypatch.setattr(iterable, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank in range(2):
            stream_for_rank(WorkerSplit(0, N), DistContext(rank=rank, world_size=2), 0, 2)
    said = [str(w.message) for w in caught if "not over ranks" in str(w.message)]
    assert len(said) == 1 and "shard=False" in said[0] and "get_rank()" in said[0]


def test_a_stream_split_by_rank_and_worker_is_used_as_it_is():
    """One that reads the rank (torch.distributed or RANK) is this rank's part already, with workers or not."""
    for workers in (0, 2):
        assert stream_for_rank(SelfSharding(N), DistContext(rank=1, world_size=2), 7, workers) is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,workers", [(2, 1), (2, 2)])
def test_a_stream_shuffling_inside_iter_is_partitioned(world, workers):
    """Every reader walks the same permutation of the epoch (it was 13 duplicated, 13 missing of 40)."""
    epochs = [job_items(ShufflingFiles(N), world, workers, epoch) for epoch in range(2)]
    assert [counts(e, N) for e in epochs] == [exact(N)] * 2
    assert epochs[0] != epochs[1]  # a new permutation each epoch


def test_the_main_process_keeps_its_own_random_streams_while_a_stream_shuffles():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader = PreparedLoader(DataLoader(ShufflingFiles(N), batch_size=4), DistContext(), seed=1)
    drawn = []
    for _ in loader:
        drawn.append(torch.rand(1))
        if len(drawn) == 3:
            break
    assert torch.equal(torch.cat(drawn), expected)


def test_an_item_split_is_said_once_with_the_choice(monkeypatch):
    monkeypatch.setattr(iterable, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank in range(2):
            stream_for_rank(ShufflingFiles(N), DistContext(rank=rank, world_size=2), 0, 0)
    said = [str(w.message) for w in caught if "item by item" in str(w.message)]
    assert len(said) == 1 and "shard=False" in said[0] and "ShardedStream" in said[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_shards", [8, 3])
@pytest.mark.parametrize("world,workers", [(2, 2), (4, 2)])
def test_a_sharded_stream_reads_each_shard_once_in_the_job(tmp_path, num_shards, world, workers):
    paths = write_jsonl_shards(tmp_path, N, num_shards)
    corpus = sum(os.path.getsize(p) for p in paths)
    log = tmp_path / "log"
    log.mkdir()
    items = job_items(ShardedStream(paths, CountingReader(str(log)), shuffle=True), world, workers)
    assert counts(items, N) == exact(N)
    readers = world * workers
    if num_shards >= readers:
        assert bytes_logged(str(log)) == corpus  # once in the whole job
    else:  # fewer shards than readers: the readers sharing a shard each read it
        assert bytes_logged(str(log)) <= corpus * -(-readers // num_shards)


@pytest.mark.timeout(120)
def test_webdataset_style_tar_shards(tmp_path):
    paths = []
    for s in range(4):
        path = tmp_path / f"shard-{s}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(s, N, 4):
                for ext, payload in (("cls", str(i).encode()), ("txt", b"item %d" % i)):
                    member = tmp_path / f"{i:04d}.{ext}"
                    member.write_bytes(payload)
                    tar.add(member, arcname=f"{i:04d}.{ext}")
        paths.append(str(path))
    samples = [
        s
        for rank in range(2)
        for s in stream_for_rank(ShardedStream(paths, tar_samples), DistContext(rank=rank, world_size=2), 0, 0)
    ]
    assert counts([int(s["cls"]) for s in samples], N) == exact(N)
    assert all(s["txt"] == b"item %d" % int(s["__key__"]) for s in samples)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_files", [4, 1])
def test_hugging_face_streaming_dataset_is_split_by_shard(tmp_path, num_files, monkeypatch):
    monkeypatch.setattr(iterable, "_warned", set())
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra: pip install phalanx[datasets]")
    paths = write_jsonl_shards(tmp_path, N, num_files)
    stream = datasets.load_dataset(
        "json", data_files=paths, split="train", streaming=True, cache_dir=str(tmp_path / "cache")
    ).select_columns(["i"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = job_items(stream, 2, 2 if num_files == 4 else 1)
    assert counts(items, N) == exact(N)
    fewer = [w for w in caught if "shards for 2 data-parallel ranks" in str(w.message)]
    assert len(fewer) == (num_files < 2)


class Plain(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(N))


def stream_of(kind: str, folder) -> torch.utils.data.IterableDataset:
    if kind == "sharded_stream":
        log = folder / "log"
        log.mkdir(exist_ok=True)
        return ShardedStream(write_jsonl_shards(folder, N, 4), CountingReader(str(log)), shuffle=True)
    return {"plain": Plain, "self_sharding": lambda: SelfSharding(N), "shuffling": lambda: ShufflingFiles(N)}[kind]()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["plain", "self_sharding", "shuffling", "sharded_stream"])
def test_a_stream_with_workers_resumes_with_the_next_batch(kind, tmp_path):
    def make():
        return PreparedLoader(DataLoader(stream_of(kind, tmp_path), batch_size=4, num_workers=2), DistContext(), seed=1)

    reference = make()
    expected = [ids(b) for _ in range(2) for b in reference]
    first = make()
    it = iter(first)
    done = [ids(next(it)) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert done + [ids(b) for _ in range(2) for b in resumed] == expected
    assert [counts([i for b in expected[k * 10 : (k + 1) * 10] for i in b], N) for k in range(2)] == [exact(N)] * 2


def test_a_per_rank_stream_position_on_another_world_size_is_refused_with_the_choices():
    (loader,) = [PreparedLoader(DataLoader(Plain(), batch_size=4), DistContext(), seed=1)]
    state = {"epoch": 0, "unit": "batches_per_rank", "consumed": 3, "world_size": 2, "global_batch": 1}
    with pytest.raises(ValueError, match=r"saved on 2 ranks cannot map to 1.*HINT: resume on 2 ranks"):
        loader.load_state_dict(state)


@pytest.mark.timeout(180)
def test_hugging_face_parquet_files_map_style_and_streaming(tmp_path):
    """Local Parquet files: as a map-style Dataset (phalanx's sampler) and streamed (split by file)."""
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra: pip install phalanx[datasets]")
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for s in range(4):
        paths.append(str(tmp_path / f"part-{s}.parquet"))
        pq.write_table(pa.table({"i": list(range(s, N, 4))}), paths[-1])
    table = datasets.load_dataset("parquet", data_files=paths, split="train", cache_dir=str(tmp_path / "cache"))
    ranks = [
        PreparedLoader(
            DataLoader(table.with_format("torch"), batch_size=4, shuffle=True),
            DistContext(rank=r, world_size=2),
            seed=1,
        )
        for r in range(2)
    ]
    assert counts([i for loader in ranks for b in loader for i in ids(b)], N) == exact(N)
    stream = datasets.load_dataset(
        "parquet", data_files=paths, split="train", streaming=True, cache_dir=str(tmp_path / "cache")
    )
    assert counts(job_items(stream, 2, 2), N) == exact(N)


def test_a_datasets_stream_split_for_other_ranks_is_refused_with_the_fix(tmp_path):
    """split_dataset_by_node for rank 1 of 4, read by data-parallel rank 0 of 2: it would read another rank's part."""
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra: pip install phalanx[datasets]")
    from datasets.distributed import split_dataset_by_node

    stream = datasets.load_dataset(
        "json",
        data_files=write_jsonl_shards(tmp_path, 8, 4),
        split="train",
        streaming=True,
        cache_dir=str(tmp_path / "cache"),
    )
    assert stream_for_rank(split_dataset_by_node(stream, 0, 2), DistContext(rank=0, world_size=2), 0, 0) is None
    with pytest.raises(ValueError, match=r"rank 1 of 4.*rank 0 of 2.*HINT: split it with split_dataset_by_node"):
        stream_for_rank(split_dataset_by_node(stream, 1, 4), DistContext(rank=0, world_size=2), 0, 0)
