"""Checkpoint locations given as URLs (`s3://bucket/prefix`, `gs://...`, any installed fsspec
filesystem), with the few `pathlib.Path` methods the checkpoint code uses.

`location(text)` is the one door: a URL becomes an `ObjectPath`, anything else a `Path`, so
`checkpoint_dir s3://bucket/run1` can never turn into a local directory named `s3:`. Credentials
and endpoints come from where the filesystem's own library looks (for S3: the AWS_* variables,
`AWS_ENDPOINT_URL` for S3-compatible stores, ~/.aws/config and ~/.aws/credentials).

Object stores have no rename and no directories: a "directory" is a key prefix that exists while
an object lies under it. The checkpoint code therefore commits a checkpoint by writing its
manifest last (atomic.py), and never relies on an empty directory.
"""

from __future__ import annotations

import functools
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from phalanx.config.kinds import is_url

# Filesystems whose "directories" are key prefixes: makedirs would create a bucket, not a folder.
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}


def location(where: str | Any) -> "Path | ObjectPath":
    """A checkpoint location: `ObjectPath` for a URL, `Path` for everything else."""
    if isinstance(where, (Path, ObjectPath)):
        return where
    text = str(where)
    if is_url(text) and not text.startswith("file://"):
        return ObjectPath.parse(text)
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def _filesystem(protocol: str) -> Any:
    """The fsspec filesystem for `protocol`, one per process: s3fs's is not fork-safe, and a launcher
    that probed the store forks its workers."""
    return _filesystem_of_process(protocol, os.getpid())


@functools.lru_cache(maxsize=None)
def _filesystem_of_process(protocol: str, pid: int) -> Any:
    """ImportError names the package to install."""
    import fsspec

    try:
        return fsspec.filesystem(protocol)
    except (ImportError, ValueError) as error:
        hint = (
            "pip install 'phalanx[s3]' (s3fs)"
            if protocol in ("s3", "s3a")
            else f"install the fsspec implementation for {protocol}:// (e.g. gcsfs for gs://, adlfs for az://)"
        )
        raise ImportError(
            f"checkpoints at {protocol}:// need an fsspec filesystem for it: {error}. HINT: {hint}"
        ) from None


@dataclass(frozen=True)
class _Stat:
    st_size: int


@dataclass(frozen=True, order=True)
class ObjectPath:
    """`protocol://key`: a location in an fsspec filesystem, pathlib-like for what checkpoints need."""

    protocol: str
    key: str  # "bucket/prefix/name", no leading or trailing slash

    @classmethod
    def parse(cls, url: str) -> "ObjectPath":
        protocol, _, rest = url.partition("://")
        key = posixpath.normpath(rest.strip("/")) if rest.strip("/") else ""
        if not key or key == ".":
            raise ValueError(f"{url!r}: no bucket in the URL. HINT: {protocol}://BUCKET/PREFIX")
        return cls(protocol, key)

    # ---- pure path operations ------------------------------------------------------------------
    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.protocol, posixpath.join(self.key, str(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def parent(self) -> "ObjectPath":
        parent = posixpath.dirname(self.key)
        return ObjectPath(self.protocol, parent) if parent else self

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    @property
    def fs(self) -> Any:
        return _filesystem(self.protocol)

    @property
    def is_object_store(self) -> bool:
        """True where directories are key prefixes (S3, GCS, Azure...)."""
        return self.protocol in _OBJECT_STORES

    # ---- filesystem operations (listings are never cached: other ranks write too) -------------------
    def _fresh(self) -> Any:
        fs = self.fs
        fs.invalidate_cache()
        return fs

    def exists(self) -> bool:
        return self._fresh().exists(self.key)

    def is_file(self) -> bool:
        return self._fresh().isfile(self.key)

    def is_dir(self) -> bool:
        return self._fresh().isdir(self.key)

    def iterdir(self) -> Iterator["ObjectPath"]:
        fs = self._fresh()
        if not fs.isdir(self.key):
            return iter(())
        names = sorted({posixpath.basename(entry.rstrip("/")) for entry in fs.ls(self.key, detail=False)})
        return iter([self / name for name in names if name])

    def glob(self, pattern: str) -> Iterator["ObjectPath"]:
        return iter(
            sorted(ObjectPath(self.protocol, found) for found in self._fresh().glob(posixpath.join(self.key, pattern)))
        )

    def stat(self) -> _Stat:
        return _Stat(int(self._fresh().info(self.key)["size"]))

    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.key, mode)

    def read_text(self) -> str:
        with self.open("r") as f:
            return f.read()

    def read_bytes(self) -> bytes:
        with self.open("rb") as f:
            return f.read()

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def write_bytes(self, data: bytes) -> None:
        """One upload, no file object: a buffered file whose upload failed retries it when collected,
        minutes later, and prints the client library's traceback from its `__del__`."""
        self.fs.pipe_file(self.key, data)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        if not self.is_object_store:  # on S3 makedirs would create a missing bucket: never do that
            self.fs.makedirs(self.key, exist_ok=True)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        fs = self._fresh()
        if fs.exists(self.key):
            fs.rm(self.key, recursive=True)

    def move(self, target: "ObjectPath") -> None:
        """Copy-then-delete on object stores: not atomic, used only to set a damaged checkpoint aside."""
        self.fs.mv(self.key, target.key, recursive=True)


def rmtree(path: "Path | ObjectPath", ignore_errors: bool = False) -> None:
    """shutil.rmtree for either kind of location."""
    import shutil

    if isinstance(path, ObjectPath):
        try:
            path.rmtree()
        except Exception:  # noqa: BLE001 - a store client's errors (botocore's) are not OSErrors
            if not ignore_errors:
                raise
        return
    shutil.rmtree(path, ignore_errors=ignore_errors)
