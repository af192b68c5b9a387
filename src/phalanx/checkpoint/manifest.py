"""The manifest: what a checkpoint holds and the size and sha256 of every file, so damage is caught."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from phalanx.checkpoint.object_path import location

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2  # 2: optimizer state flattened, one key per parameter (checkpoint/state.py)
READABLE_VERSIONS = (1, 2)  # 1: torch's nested optimizer state
_CHUNK = 1 << 20


class CheckpointDamaged(RuntimeError):
    """A checkpoint failed verification; the message names the file and what is wrong with it."""


@dataclass
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    """Written last into a staged checkpoint; its presence marks the checkpoint complete."""

    step: int
    world_size: int
    strategy: str
    files: dict[str, FileEntry] = field(default_factory=dict)  # relative path -> entry
    format_version: int = FORMAT_VERSION
    created_unix: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        files = {name: FileEntry(**entry) for name, entry in raw.pop("files").items()}
        return cls(files=files, **raw)


def hash_file(path: Path, fsync: bool = True) -> FileEntry:
    """Size and sha256 of `path`; with `fsync`, also flush it to disk (the data is hot in cache)."""
    digest = hashlib.sha256()
    local = isinstance(path, Path)
    size = 0
    with open(path, "rb") if local else path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if fsync and local:  # an uploaded object is durable already
            os.fsync(f.fileno())
    return FileEntry(size=size, sha256=digest.hexdigest())


def hash_files(
    directory: Path, names: Iterable[str], known: dict[str, FileEntry] | None = None
) -> dict[str, FileEntry]:
    """Size and sha256 of each file; those in `known` (hashed while they were uploaded) are not read again."""
    known = known or {}
    return {name: known[name] if name in known else hash_file(directory / name) for name in names}


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write the manifest, whole or not at all: it is what commits a checkpoint."""
    if not isinstance(directory, Path):  # a URL: one PUT is atomic
        (directory / MANIFEST_NAME).write_text(manifest.to_json())
        return
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)


def read_manifest(directory: Path) -> Manifest:
    path = location(directory) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointDamaged(
            f"{path}: manifest missing: the checkpoint is incomplete (a save was interrupted) or is "
            "not a phalanx checkpoint"
        )
    try:
        manifest = Manifest.from_json(path.read_text())
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise CheckpointDamaged(f"{path}: manifest corrupted ({type(error).__name__}: {error})") from error
    if manifest.format_version not in READABLE_VERSIONS:
        raise CheckpointDamaged(
            f"{path}: format version {manifest.format_version}, this phalanx reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}. HINT: load it with the phalanx version that wrote it"
        )
    return manifest


def verify_files(directory: Path, manifest: Manifest, names: Iterable[str] | None = None) -> list[str]:
    """Check listed files (all, or `names`) against the manifest; return one message per bad file."""
    directory = location(directory)
    problems = []
    for name in sorted(manifest.files if names is None else names):
        entry, path = manifest.files[name], directory / name
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists {entry.size} bytes)")
            continue
        size = path.stat().st_size
        if size != entry.size:
            problems.append(f"{path}: {size} bytes, the manifest says {entry.size} (truncated or overwritten)")
            continue
        actual = hash_file(path, fsync=False).sha256
        if actual != entry.sha256:
            problems.append(f"{path}: sha256 {actual[:12]}..., the manifest says {entry.sha256[:12]}... (corrupted)")
    return problems
