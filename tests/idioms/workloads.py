"""Rank functions of the idiom corpus: every script of tests.idioms.corpus under each of the given
layouts in one spawn of ranks (one process group serves every cell), after this spawn's share of the
references: the same scripts with `Plain()`, plain torch in one process with no phalanx (run before
any Phalanx() in the process, split between the ranks so that they run side by side)."""

from __future__ import annotations

import os
import re
from typing import Any

from tests.idioms.corpus import SCRIPTS, uneven_reference
from tests.idioms.plain import Plain
from tests.idioms.table import LAYOUTS


def _scratch(root: str, *names: str) -> str:
    path = os.path.join(root, "-".join(re.sub(r"[^A-Za-z0-9]+", "_", n) for n in names))
    os.makedirs(path, exist_ok=True)
    return path


def references(idioms: list[str], dp_sizes: list[int], root: str, share: tuple[int, int] = (0, 1)) -> dict[Any, dict]:
    """Each script with `Plain()`, `uneven-reduce` as torch's Join runs it on each of `dp_sizes` ranks
    (keyed (idiom, dp size)); `share` (i, n): only every n-th of those jobs from the i-th."""
    jobs: list[tuple[Any, Any]] = []
    for idiom in idioms:
        if idiom == "uneven-reduce":
            jobs += [((idiom, n), lambda n=n: uneven_reference(n)) for n in dp_sizes]
        else:
            jobs.append((idiom, lambda idiom=idiom: SCRIPTS[idiom](Plain(), _scratch(root, "plain", idiom))))
    index, count = share
    return {key: job() for key, job in jobs[index::count]}


def cells(layouts: list[str], idioms: list[str], root: str) -> dict[Any, Any]:
    """{"references": this rank's share of them, (layout, idiom): the cell's result on this rank}.
    A refusal (a ValueError, or any error with phalanx's "HINT:") is the cell's result, as is any
    other error (a bug the test reports)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dp_sizes = sorted({LAYOUTS[name].processes // _model_degree(name) for name in layouts})
    out: dict[Any, Any] = {"references": references(idioms, dp_sizes, root, (rank, world))}
    from phalanx import Phalanx  # after the references: they run with no phalanx in the process

    for name in layouts:
        for idiom in idioms:
            try:
                px = Phalanx(**LAYOUTS[name].settings)
                result = SCRIPTS[idiom](px, _scratch(root, name, idiom))
                result["dp_size"] = px.dp_size
            except ValueError as error:
                result = {"refused": str(error)}
            except Exception as error:  # noqa: BLE001 - the outcome of the cell, which the test reports
                said = f"{type(error).__name__}: {error}"
                result = {"refused": said} if "HINT:" in str(error) else {"error": said}
            out[(name, idiom)] = result
            print(f"cell {name} / {idiom}: { ({k: v for k, v in result.items() if k != 'state'}) }", flush=True)
    return out


def _model_degree(layout: str) -> int:
    """tp x pp x cp of a layout (the rest of its processes are data-parallel)."""
    settings = LAYOUTS[layout].settings
    return settings.get("tp", 1) * settings.get("pp", 1) * settings.get("cp", 1)
