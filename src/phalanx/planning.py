"""`phalanx plan train.py` reads a training script's model without running its loop.

Importing a script runs its top level; a script without an `if __name__ == "__main__":` guard would
train there. While `phalanx plan` imports it (`reading_script()`), `from phalanx import Phalanx` gives
the stand-in (phalanx/__init__.py asks `active()`; the facade is not touched): a world
of one that joins no group and writes no run directory, puts every tensor made after it on the meta
device (any size is free), and stops the script at its first `px.prepare(...)` with `PlanStop`,
which carries the model prepare was given and where. No torch at import (a leaf anyone may import).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

_reading: list[contextlib.ExitStack] = []  # one while `phalanx plan` imports a script


class PlanStop(BaseException):
    """The script reached `px.prepare` (or used what only a running job has) while `phalanx plan`
    read it. A BaseException, as SystemExit is: a script's `except Exception` must not swallow it."""

    def __init__(self, model: Any, where: str, what: str):
        super().__init__(f"{what} at {where}")
        self.model, self.where, self.what = model, where, what


def active() -> bool:
    """Whether `phalanx plan` is importing a script now (Phalanx() is then a `StandIn`)."""
    return bool(_reading)


@contextlib.contextmanager
def reading_script() -> Iterator[None]:
    """While inside, `Phalanx()` is a StandIn; the meta device it enters is left on the way out."""
    with contextlib.ExitStack() as stack:
        _reading.append(stack)
        try:
            yield
        finally:
            _reading.pop()


def _caller(depth: int = 2) -> str:
    frame = sys._getframe(depth)  # noqa: SLF001 - the script's line that called prepare
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class StandIn:
    """What `Phalanx()` returns while `phalanx plan` reads a script: rank 0 of a world of one on the
    meta device; `prepare` stops the script, and so does anything else a running job would have."""

    rank = local_rank = node_rank = 0
    world_size = 1
    is_main_process = is_local_main_process = True

    def __init__(self, *_: Any, **__: Any) -> None:  # whatever the script asks for: nothing is set up
        import torch

        _reading[-1].enter_context(torch.device("meta"))  # the model the script builds next costs nothing
        self.device = torch.device("meta")

    @classmethod
    def from_config(cls, *_: Any, **__: Any) -> "StandIn":
        return cls()

    def prepare(self, *objects: Any, **_: Any) -> Any:
        import torch

        model = next((obj for obj in objects if isinstance(obj, torch.nn.Module)), None)
        raise PlanStop(model, _caller(), "px.prepare(...)")

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs)

    def init_module(self) -> Any:  # the meta device is on already
        return contextlib.nullcontext()

    def main_process_first(self) -> Any:  # one process: it is first
        return contextlib.nullcontext()

    def wait_for_everyone(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise PlanStop(None, _caller(), f"px.{name}")
