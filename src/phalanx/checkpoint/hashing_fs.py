"""DCP's fsspec FileSystem, made to record each written file's size and sha256 as it writes it.
Used in the trainer (dcp_storage.py) and in the async writer process (writer_process.py): a module
of its own so neither imports the other for it (no cycle)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from typing import Any, Iterator

from phalanx.checkpoint.manifest import FileEntry


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
