"""A layout the script's model cannot take (pp on a model with no blocks to cut, a tp degree that does
not divide its heads...), said once (no torch here).

Only `px.prepare(model)` can know: the model is built by the script, and the launcher cannot import
a script to look at it without running it. Every rank raises the same `Refused` there. Under
`phalanx run` each worker records the message in TORCHELASTIC_ERROR_FILE (torch's JSON layout, under
a key of phalanx's own) and exits 2 without a traceback: rank 0 quiet too, the launcher prints the
message once (`phalanx run: error: ...`) and exits 2, as for a setting refused before launch. Without
a phalanx launcher (torchrun, python), rank 0 prints it and the other ranks a short line. One module
for both sides, so writer and reader cannot drift apart.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any, Iterator

KEY = "phalanx_refusal"  # under the error file's message.extraInfo
EXIT_CODE = 2  # as `phalanx run` exits for a setting refused before launch


class Refused(ValueError):
    """The parallel layout cannot run this model: raised the same on every rank, at prepare."""


@contextlib.contextmanager
def refusing() -> Iterator[None]:
    """A ValueError raised inside (prepare's refusal of the model in this layout) becomes `Refused`."""
    try:
        yield
    except Refused:
        raise
    except ValueError as error:
        raise Refused(str(error)) from error


def error_file_data(message: str) -> dict[str, Any]:
    """torch's error-file layout, with the refusal beside the message."""
    return {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time())), KEY: message},
        }
    }


def from_error_file_data(data: Any) -> str | None:
    """The refusal a worker recorded, or None when its error file says something else."""
    try:
        found = data["message"]["extraInfo"][KEY]
    except (KeyError, TypeError):
        return None
    return found if isinstance(found, str) else None


def write(path: str, message: str) -> None:
    """Record the refusal where torch's agent reads a worker's error (TORCHELASTIC_ERROR_FILE)."""
    with open(path, "w") as fp:
        json.dump(error_file_data(message), fp)


def line(rank: int, message: str, launcher: bool) -> str | None:
    """What rank `rank` prints for a refusal: the message on rank 0 (unless a phalanx launcher prints
    it), a short line elsewhere."""
    if rank == 0:
        return None if launcher else f"phalanx: refused at prepare: {message}"
    return f"phalanx (rank {rank}): refused at prepare; " + ("the launcher says why" if launcher else "rank 0 says why")


def say(error: Refused, rank: int, launcher: bool) -> None:
    """Print this rank's line for an uncaught refusal (instead of its traceback)."""
    text = line(rank, str(error), launcher)
    if text:
        print(text, file=sys.stderr, flush=True)
