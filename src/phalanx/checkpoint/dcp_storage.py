"""DCP's storage reader and writer for a checkpoint location: the local filesystem, or fsspec's
for a URL. torch keeps its fsspec classes in a private module (`_fsspec_filesystem`): this is the
one place that imports it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from phalanx.checkpoint import writer_process
from phalanx.checkpoint.hashing_fs import hashing
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
