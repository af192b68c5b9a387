"""Phalanx's own attention calls SDPA: inside `paused()` those calls pass the cp routing (routing.py)
untouched. A module of its own so the attention (cut_attention.py) and the routing that calls it
(routing.py) do not import each other (no cycle)."""

from __future__ import annotations

import contextlib
from typing import Iterator

_paused: list[bool] = []  # phalanx's own attention calls SDPA: those pass through


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """SDPA calls inside go to torch as written (attention's own computation)."""
    _paused.append(True)
    try:
        yield
    finally:
        _paused.pop()


def is_paused() -> bool:
    """Whether SDPA calls now go to torch as written."""
    return bool(_paused)
