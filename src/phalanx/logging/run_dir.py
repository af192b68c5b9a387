"""The run directory: where metrics files and per-rank logs of one run go, the same on every rank."""

from __future__ import annotations

import os
import time
from typing import Callable


DEFAULT_ROOT = "runs"


def make_unique_dir(root: str, now: float | None = None) -> str:
    """Create `root/<YYYYmmdd-HHMMSS>` (suffixed -1, -2... if taken) and return its absolute path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    os.makedirs(root, exist_ok=True)
    for attempt in range(1000):
        path = os.path.abspath(os.path.join(root, stamp if attempt == 0 else f"{stamp}-{attempt}"))
        try:
            os.mkdir(path)  # atomic: two runs starting in the same second get different dirs
            return path
        except FileExistsError:
            continue
    raise RuntimeError(
        f"could not create a fresh run directory under {root!r}. HINT: set run_dir (--run-dir, PHALANX_RUN_DIR)."
    )


def resolve_run_dir(chosen: str | None, is_main: bool, share: Callable[[str | None], str]) -> str:
    """The run_dir setting if given (the launcher or the user chose), else a fresh `runs/<time>`.

    `share(value)` returns rank 0's value on every rank (a broadcast; identity in a world of one),
    so all ranks agree on one directory without a shared clock.
    """
    if chosen:
        path = os.path.abspath(chosen)
        os.makedirs(path, exist_ok=True)
        return path
    return share(make_unique_dir(DEFAULT_ROOT) if is_main else None)
