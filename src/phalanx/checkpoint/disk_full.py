"""Naming a full disk when a save fails on one: "the filesystem of the checkpoint directory is full",
with the bytes the checkpoint needs and the bytes free, instead of only torch's zip writer saying
"[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598"."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

_NO_SPACE = ("No space left on device", f"[Errno {errno.ENOSPC}]", "Disk quota exceeded", f"[Errno {errno.EDQUOT}]")
_ZIP_WRITER = ("unexpected pos", "PytorchStreamWriter failed")  # torch.save's writer, when a write came up short


DCP_ENTRY_BYTES = 1536
"""What DCP writes per state entry beside its data: each entry (a tensor, an optimizer's `lr`) is a
small torch.save record in a shard (1261 bytes for a scalar, measured) plus its row in `.metadata`
(about 235). A model of 4 tensors under AdamW is 68 entries: 100 KiB of the 142 KiB it writes."""
RANK_FILE_BYTES = 16 * 1024
"""Each rank's own file (`rankN.pt`: its RNG states and data positions, 15.6 KiB measured)."""


def estimate(data_bytes: int, entries: int, ranks: int, previous: Path | None) -> int:
    """The bytes a checkpoint writes: its tensors' data, DCP's cost per entry, each rank's own file; or
    what the previous checkpoint took (`previous`, a local directory), when that is more."""
    guess = data_bytes + entries * DCP_ENTRY_BYTES + ranks * RANK_FILE_BYTES
    if previous is None or not isinstance(previous, Path) or not previous.is_dir():
        return guess
    try:
        took = sum(path.stat().st_size for path in previous.iterdir() if path.is_file())
    except OSError:
        return guess
    return max(guess, took)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def note(root: object, errors: Iterable[str], needed: Callable[[], int]) -> str | None:
    """The sentence to add when `errors` come from a full filesystem under the local `root`, else None.

    An error that says ENOSPC is enough; torch's zip-writer error counts when the space free is
    less than the checkpoint needs (it loses the errno)."""
    if not isinstance(root, (str, os.PathLike)):  # an object store has no filesystem to fill
        return None
    text = " ".join(errors)
    says_full = any(mark in text for mark in _NO_SPACE)
    if not says_full and not any(mark in text for mark in _ZIP_WRITER):
        return None
    usage = shutil.disk_usage(_existing(Path(root)))
    need = needed()
    if not says_full and usage.free >= need:
        return None
    return (
        f"the filesystem of the checkpoint directory {root} is full: the checkpoint needs about {need} bytes "
        f"({_human(need)}), {usage.free} bytes are free ({_human(usage.free)} of {_human(usage.total)})"
    )


HINT = "free space there, lower checkpoint_keep, or point checkpoint_dir at a larger filesystem"
"""The fix for a full disk, said last in the message."""


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
