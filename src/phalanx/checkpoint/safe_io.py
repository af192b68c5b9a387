"""Reading checkpoint files without running code from them.

DCP reads its `.metadata` with `pickle.load` and non-tensor values with `torch.load(weights_only=
False)`: a crafted checkpoint could execute code. These replacements allow only DCP's own metadata
classes and plain data; everything else phalanx writes is loaded with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never needs; "
            "refusing to load it (it could run code)"
        )


def load_metadata(path: str | pathlib.Path, stream: Any = None) -> Metadata:
    """DCP's `.metadata` at `path` (or read from the open `stream`), through the allowlist."""
    with open(path, "rb") if stream is None else contextlib.nullcontext(stream) as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeMetadataMixin:
    """For a DCP FileSystemReader (local or fsspec): its metadata is unpickled through an allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as stream:  # type: ignore[attr-defined]
            metadata = load_metadata(path, stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class SafeFileSystemReader(SafeMetadataMixin, FileSystemReader):
    """FileSystemReader whose metadata is unpickled through an allowlist."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # The weights_only load refuses any pickle that names a global outside torch's safe set;
        # once it passed, the parent's own load of the same bytes can only build plain data.
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def load_plain(path: Any) -> Any:
    """torch.load of a phalanx side file (a local path or an ObjectPath): tensors and plain containers only."""
    if not isinstance(path, (str, pathlib.Path)):  # at a URL: one GET, then parsed in memory
        with path.open("rb") as f:
            return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True)


_PLAIN = (int, float, bool, str, bytes, type(None), torch.Tensor, torch.Size, torch.dtype)


def check_plain(obj: Any, where: str) -> None:
    """Raise ValueError if `obj` holds anything `weights_only=True` loading would refuse."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple, set)):
        for i, item in enumerate(obj):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for key, item in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise ValueError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoint keys must be plain")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise ValueError(
        f"{where} is a {type(obj).__module__}.{type(obj).__name__}; phalanx checkpoints hold only "
        "tensors, numbers, strings and lists/tuples/dicts of them, so loading never runs code. "
        "HINT: convert it in your object's state_dict() (e.g. a numpy array -> torch.from_numpy)"
    )
