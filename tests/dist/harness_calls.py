"""Several workload calls, in order, in one rank launch (one process group for all of them)."""

from __future__ import annotations

import importlib
from typing import Any, Sequence


def calls(targets: Sequence[tuple[str, tuple]]) -> list[Any]:
    results = []
    for target, args in targets:
        module, name = target.split(":")
        results.append(getattr(importlib.import_module(module), name)(*args))
    return results
