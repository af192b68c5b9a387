"""Publishing a checkpoint so a crash at any moment leaves the previous one intact and loadable.

A save is written into `.staging-<name>/`, fsynced, completed by its manifest, then renamed to
`<name>/` (a rename is atomic on POSIX filesystems), and only then is the `latest` pointer moved
(also write-then-rename). Loading picks the newest published checkpoint that verifies.

At a URL (object_path.py) there is no rename: a save is written straight into `<name>/`, and the
manifest, written last, commits it (one PUT is atomic). A `<name>/` without a manifest is a save
that was cut off: never a candidate for loading, and removed by the next save.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from phalanx.checkpoint.manifest import MANIFEST_NAME, CheckpointDamaged, read_manifest
from phalanx.checkpoint.object_path import ObjectPath, rmtree

LATEST_NAME = "latest"
STAGING_PREFIX = ".staging-"
_STEP_DIR = re.compile(r"^step-(\d+)$")

log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_path(final: Path) -> Path:
    """Where a save of `final` is written: beside it to be renamed, or `final` itself at a URL."""
    if isinstance(final, ObjectPath):
        return final
    return final.parent / (STAGING_PREFIX + final.name)


def fsync_dir(path: Path) -> None:
    if isinstance(path, ObjectPath):  # an object is durable once its upload returned
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_staging(final: Path) -> Path:
    """Create an empty staging directory for `final` (removing a leftover of a crashed save)."""
    if is_published(final) if isinstance(final, ObjectPath) else final.exists():
        raise FileExistsError(
            f"checkpoint {final} already exists; phalanx never overwrites a checkpoint. "
            "HINT: save to another path, or delete it first if you mean to replace it"
        )
    if isinstance(final, ObjectPath):
        remove_uncommitted(final.parent)
        rmtree(final)  # a cut-off save of this very name, outside a managed root
        return final
    staging = staging_path(final)
    if staging.is_symlink() or staging.exists():
        log.warning("phalanx: %s", remove_staging(staging, "left by an interrupted save"))
    staging.mkdir(parents=True)
    return staging


def remove_staging(staging: Path, why: str = "") -> str:
    """Remove a local staging path without following a symbolic link; return what was done, truly.
    A link is unlinked and its target left as it was; a file is unlinked; a directory removed."""
    why = f", {why}," if why else ""
    try:
        if staging.is_symlink():
            target = os.readlink(staging)
            staging.unlink()
            return (
                f"the staging path {staging}{why} was a symbolic link to {target}: the link was removed, "
                "its target left as it was"
            )
        if staging.is_dir():
            shutil.rmtree(staging)
        elif staging.exists():
            staging.unlink()
    except OSError as error:
        return f"the staging directory {staging}{why} could not be removed ({error})"
    return f"the staging directory {staging}{why} was removed"


def publish(staging: Path, final: Path) -> None:
    """Rename the complete staging directory to its final name, durably."""
    if not (staging / MANIFEST_NAME).is_file():
        raise RuntimeError(f"refusing to publish {staging}: it has no manifest (the save did not finish)")
    if isinstance(final, ObjectPath):  # committed by its manifest already: nothing to rename
        return
    fsync_dir(staging)
    if final.exists():  # checked again: another job may share the directory
        raise FileExistsError(f"checkpoint {final} appeared while saving; nothing was overwritten")
    os.rename(staging, final)
    fsync_dir(final.parent)


def unused_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`... whichever does not exist yet."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def is_published(path: Path) -> bool:
    """A complete checkpoint directory: renamed into place, with its manifest."""
    return path.is_dir() and (path / MANIFEST_NAME).is_file()


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at `name` (write-then-rename); on failure the old pointer stays and no tmp file."""
    if isinstance(root, ObjectPath):  # one PUT replaces the object whole, or not at all
        (root / LATEST_NAME).write_text(name + "\n")
        return
    tmp = root / (LATEST_NAME + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    path = root / LATEST_NAME
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def published(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoints under `root` as (step, path), newest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (is_published(child) if isinstance(child, ObjectPath) else child.is_dir()):
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def remove_uncommitted(root: ObjectPath) -> list[ObjectPath]:
    """At a URL: remove `step-*` prefixes without a manifest (saves that were cut off); return them."""
    removed = []
    for child in root.iterdir():
        if _STEP_DIR.match(child.name) and not is_published(child):
            log.warning("phalanx: removing %s, left by an interrupted save (it has no manifest)", child)
            rmtree(child)
            removed.append(child)
    return removed


def candidates(root: Path) -> list[Path]:
    """Where to look for the latest good checkpoint, best first.

    The newest published directory comes first: it equals `latest` except when a crash fell
    between the rename and the pointer move, and then it is complete all the same.
    """
    paths = [path for _, path in published(root)]
    pointed = read_latest(root)
    if pointed and (root / pointed) not in paths and (root / pointed).is_dir():
        paths.insert(0, root / pointed)
    return paths


def latest_intact(root: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest published checkpoint whose manifest lists files that are all present
    at their recorded size (a quick check: loading also verifies checksums), or None."""

    for path in candidates(root):
        try:
            found = read_manifest(path)
        except (OSError, ValueError, KeyError, TypeError, CheckpointDamaged):  # not ours, or damaged: skipped
            continue
        if all(
            (path / name).is_file() and (path / name).stat().st_size == entry.size
            for name, entry in found.files.items()
        ):
            return found.step, path
    return None


def describe_latest(root: Path) -> str:
    """'the latest good checkpoint is step 15 (ckpt/step-00000015)' or 'there is no good checkpoint yet'."""
    found = latest_intact(root)
    if found is None:
        return f"there is no good checkpoint in {root} yet"
    return f"the latest good checkpoint is step {found[0]} ({found[1]})"


class CheckpointDirNotWritable(ValueError):
    """checkpoint_dir cannot be written: refused before training starts."""


def check_writable(root: Path) -> None:
    """Create `root` if needed, then write, sync and remove a small probe file in it.

    Permissions alone would not do: root may write anywhere but a read-only or full filesystem.
    At a URL, the store is probed instead (storage_probe.py): bucket, credentials, access, endpoint.
    """
    if isinstance(root, ObjectPath):
        from phalanx.checkpoint.storage_probe import probe

        problem = probe(root)
        if problem:
            raise CheckpointDirNotWritable(f"checkpoint_dir {root} cannot be written: {problem}")
        return
    probe = root / f".phalanx-write-check-{os.getpid()}"
    created = False
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            created = True
            f.write(b"phalanx")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as error:
        if created:
            probe.unlink(missing_ok=True)
        raise CheckpointDirNotWritable(
            f"checkpoint_dir {root} cannot be written: {error}. HINT: choose a directory on a writable "
            "filesystem with free space (--checkpoint-dir DIR, PHALANX_CHECKPOINT_DIR or checkpoint_dir:)"
        ) from None


def prune(root: Path, keep: int, protect: Path) -> list[Path]:
    """Delete published checkpoints beyond the newest `keep` (never `protect`); return them."""
    if keep <= 0:
        return []
    removed = []
    for _, path in published(root)[keep:]:
        if path != protect:
            rmtree(path)
            removed.append(path)
    return removed


def is_managed_root(path: Path) -> bool:
    """A directory of checkpoints (has `latest` or step-* dirs) rather than one checkpoint."""
    if (path / LATEST_NAME).is_file() or published(path):
        return True
    if isinstance(path, ObjectPath):  # an empty prefix does not exist on an object store
        return not (path / MANIFEST_NAME).exists() and not any(path.glob("*.distcp"))
    return path.is_dir() and not (path / MANIFEST_NAME).exists() and not any(path.glob("*.distcp"))
