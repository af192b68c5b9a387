"""A private temporary directory for one launch, removed when it ends.

torch's process starter writes a `/tmp/pytorch-errorfile-*.pickle` for every worker that raises and
never deletes it, and its agent makes a `/tmp/torchelastic_*` log directory per run that stays too.
Both come from `tempfile` in this (the launcher's) process: pointed at a directory of the launch's
own, they go with it.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def private_tempdir() -> Iterator[str]:
    """Route `tempfile`'s default directory to a fresh one for the duration; remove it after."""
    previous = tempfile.tempdir
    private = tempfile.mkdtemp(prefix="phalanx-launch-")
    tempfile.tempdir = private
    try:
        yield private
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(private, ignore_errors=True)
