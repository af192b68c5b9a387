"""Reading checkpoint files without running code from them.

DCP reads its `.metadata` with `pickle.load` and non-tensor values with `torch.load(weights_only=
False)`: a crafted checkpoint could execute code. These replacements allow only DCP's own metadata
classes and plain data, each named exactly (module and name, never a dotted name: pickle protocol 4
resolves `os.system` through any module that imports `os`); everything else phalanx writes is loaded
with `weights_only=True`. `file_problems` runs the same readers over a checkpoint's files before it is
chosen, so a refused file makes resume fall back to the last good step, as damage does.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import pickle
import warnings
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from phalanx.checkpoint.manifest import CheckpointDamaged, Manifest, read_manifest, verify_files
from phalanx.checkpoint.object_path import location

METADATA_NAME = ".metadata"
_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint file asked for something a checkpoint never needs (and that could run code)."""


def allowed_global(module: str, name: str) -> bool:
    """Exactly one of the pairs above, or a torch dtype by its plain name (`torch.float32`)."""
    if "." in name:
        return False
    return (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if allowed_global(module, name):
            return super().find_class(module, name)
        raise RefusedPickle(
            f"it refers to {module}.{name}, which a DCP checkpoint never needs; refusing to load it (it could run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("it holds a persistent id, which DCP metadata never has; refusing to load it")


def load_metadata(path: Any, stream: Any = None) -> Metadata:
    """DCP's `.metadata` at `path` (or read from the open `stream`), through the allowlist. Whatever
    its bytes, this runs no code: a refused or unreadable file raises RefusedPickle naming `path`."""
    opened = (
        (open(path, "rb") if isinstance(path, (str, pathlib.Path)) else path.open("rb")) if stream is None else None
    )
    with opened if opened is not None else contextlib.nullcontext(stream) as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except RefusedPickle as error:
            raise RefusedPickle(f"{path}: {error}") from None
        except Exception as error:  # any malformed pickle: opcodes, extension codes, truncation
            raise RefusedPickle(f"{path}: not readable as DCP metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata):
        raise RefusedPickle(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
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
    """torch.load of a phalanx side file (a local path or an ObjectPath): tensors and plain containers
    only. Anything else (a global outside torch's safe set, a malformed pickle) raises RefusedPickle
    naming the file and torch's reason, never torch's traceback (nor its advice to drop weights_only)."""
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": the refusal below says what matters
            warnings.simplefilter("ignore", UserWarning)
            if not isinstance(path, (str, pathlib.Path)):  # at a URL: one GET, then parsed in memory
                with path.open("rb") as f:
                    return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, KeyError, TypeError, AttributeError) as error:
        raise RefusedPickle(
            f"{path}: refused by torch.load(weights_only=True), so nothing in it ran ({_reason(error)}); "
            "a phalanx checkpoint's side files hold only tensors and plain data"
        ) from None


def _reason(error: BaseException) -> str:
    """torch's weights_only refusal without its boilerplate (the advice to load with weights_only=False
    above all): the line that names the global or opcode."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(boilerplate)]
    return " ".join(kept).replace("WeightsUnpickler error: ", "") or type(error).__name__


def file_problems(directory: Any, manifest: Manifest, names: Iterable[str] | None = None) -> list[str]:
    """One message per bad file among `names` (default: all the manifest lists): missing, truncated or
    corrupted against the manifest, or, intact, refused by the safe readers (`.metadata` and the `.pt`
    side files, read as resume, export and inspect read them). Shards' tensors are read by DCP with
    `weights_only=True` when loaded."""
    directory, found = location(directory), []
    for name in sorted(manifest.files if names is None else names):
        damage = verify_files(directory, manifest, [name])
        if damage:
            found.extend(damage)
            continue
        try:
            if name == METADATA_NAME:
                load_metadata(directory / name)
            elif name.endswith(".pt"):
                load_plain(directory / name)
        except RefusedPickle as error:
            found.append(str(error))
    return found


def verify(directory: Any) -> Manifest:
    """Read the manifest and check every file as `file_problems` does; raise CheckpointDamaged naming
    the bad files (what `phalanx export` and a load by name refuse)."""
    manifest = read_manifest(directory)
    problems = file_problems(directory, manifest)
    if problems:
        raise CheckpointDamaged("damaged checkpoint: " + "; ".join(problems))
    return manifest


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
