"""Background checkpoint threads at a lower CPU priority than the training loop.

An async save serializes, writes and hashes in threads of the training process. Where CPU cores are
shared (a CPU job, data loader workers, a busy host), those threads would take time slices from the
training step; on Linux each thread has its own nice value, so raising theirs lets the loop run
first and the save use what is left. Elsewhere this does nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

NICENESS = 10  # of 19: below the loop, still served when the cores are idle


def lower_this_thread() -> None:
    _lower(threading.get_native_id())


@contextlib.contextmanager
def threads_started_here_lowered() -> Iterator[None]:
    """Lower the priority of every thread started inside the block (e.g. DCP's writer pool)."""
    before = {thread.ident for thread in threading.enumerate()}
    try:
        yield
    finally:
        for thread in threading.enumerate():
            if thread.ident not in before and thread.native_id is not None:
                _lower(thread.native_id)


def _lower(native_id: int) -> None:
    if not hasattr(os, "setpriority") or not os.uname().sysname == "Linux":
        return  # per-thread nice values are Linux's; elsewhere setpriority would renice the process
    try:
        current = os.getpriority(os.PRIO_PROCESS, native_id)
        os.setpriority(os.PRIO_PROCESS, native_id, max(current, NICENESS))
    except (OSError, ProcessLookupError):  # the thread ended already
        return
