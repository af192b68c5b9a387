"""DCP's storage reader and writer for a checkpoint location: the local filesystem, or fsspec's
for a URL. torch keeps its fsspec classes in a private module (`_fsspec_filesystem`): this is the
one place that imports it."""
from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter

from phalanx.checkpoint import writer_process
from phalanx.checkpoint.manifest import FileEntry
from phalanx.checkpoint.object_path import ObjectPath
from phalanx.checkpoint.safe_io import SafeFileSystemReader, SafeMetadataMixin


def writer(path: Path | ObjectPath, written: dict[str, FileEntry] | None = None, for_async: bool = False) -> Any:
    """A StorageWriter into `path`. Local files are fsynced. Uploaded objects are durable already, and
    each one's size and sha256 go into `written` as it is uploaded, so the manifest needs no download.
    `for_async`: the shards of an async save are written by a helper process (writer_process.py),
    which hashes every file as it writes it, local or uploaded."""
    if isinstance(path, ObjectPath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        base: type = FsspecWriter
        target, sync = str(path), False
    else:
        base = FileSystemWriter
        target, sync = path, True
    if for_async and writer_process.supported():
        base = writer_process.out_of_process(base)
    storage = base(target, sync_files=sync)
    if written is not None:
        storage.written = written
        if isinstance(path, ObjectPath):
            storage.fs = hashing(storage.fs, written)
    return storage


def reader(path: Path | ObjectPath) -> Any:
    """A StorageReader of `path` whose metadata is unpickled through the allowlist (safe_io.py)."""
    if isinstance(path, ObjectPath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(SafeMetadataMixin, FsspecReader):
            pass

        return SafeFsspecReader(str(path))
    return SafeFileSystemReader(path)


class _HashingStream:
    """A write stream that hashes what passes through it (DCP writes its files front to back)."""

    def __init__(self, raw: Any):
        self._raw, self._digest, self.size = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._digest.update(view)
        self.size += view.nbytes
        return self._raw.write(data)

    def entry(self) -> FileEntry:
        return FileEntry(size=self.size, sha256=self._digest.hexdigest())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def hashing(fs: Any, written: dict[str, FileEntry]) -> Any:
    """DCP's fsspec FileSystem `fs`, recording each written file's FileEntry in `written` by name."""
    plain_create_stream = fs.create_stream

    @contextlib.contextmanager
    def create_stream(path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with plain_create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        written[posixpath.basename(os.fspath(path))] = hashing.entry()

    fs.create_stream = create_stream
    return fs
