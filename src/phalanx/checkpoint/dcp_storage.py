"""DCP's storage reader and writer for a checkpoint location: the local filesystem, or fsspec's
for a URL. torch keeps its fsspec classes in a private module (`_fsspec_filesystem`): this is the
one place that imports it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from phalanx.checkpoint.object_path import ObjectPath
from phalanx.checkpoint.safe_io import SafeFileSystemReader, SafeMetadataMixin


def writer(path: Path | ObjectPath) -> Any:
    """A StorageWriter into `path`; local files are fsynced, uploaded objects are durable already."""
    if isinstance(path, ObjectPath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(path), sync_files=False)
    return FileSystemWriter(path, sync_files=True)


def reader(path: Path | ObjectPath) -> Any:
    """A StorageReader of `path` whose metadata is unpickled through the allowlist (safe_io.py)."""
    if isinstance(path, ObjectPath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(SafeMetadataMixin, FsspecReader):
            pass

        return SafeFsspecReader(str(path))
    return SafeFileSystemReader(path)
