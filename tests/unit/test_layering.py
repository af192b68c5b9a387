"""The rooms' doors: every package (and every module at the package root) has a place in one order,
and imports only the rooms before it: no import against the layering, so no cycle. Checked on the
source, so a lazy import inside a function counts too, and so does a module named in a string
(`cli.py` imports its subcommands by name)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

# Bottom first: a room may import the rooms before it. Everyone may import the leaves.
LEAVES = {
    "envvars",
    "store_keys",
    "preemption_report",
    "refusal",
    "planning",
    "__version__",
}  # names, keys and the refusal error: no imports of phalanx
ORDER = [
    "config",  # the settings schema, its kinds, sources and word lists
    "logging",  # rank-aware logs, metrics, progress
    "cluster",  # what SLURM / MPI / the network say: pure functions
    "loop",  # accumulation, LR schedulers, precision
    "model",  # meta init, weight loading, units, memory estimates
    "runtime",  # inside a worker: context, process group, collectives, watchdog
    "host_only",  # gloo/host-memory workarounds that never engage on NCCL/CUDA
    "data",  # samplers, streams, the prepared loader, uneven inputs
    "checkpoint",  # save / load / resume, export
    "observe",  # step anatomy, stragglers; `phalanx top`, the dashboard
    "strategies",  # plan/ (arithmetic), then applying it (parallelize, the Strategy), optimizers/
    "preemption",  # the worker's side of preemption: signals, an agreed step, its checkpoint
    "launch",  # the launcher process (never the runtime: test_launcher_imports)
    "parity",  # `phalanx parity`
    "plan",  # `phalanx plan`
    "doctor",  # `phalanx doctor`
    "services",  # what runs beside the loop, wired for the facade
    "across_ranks",  # px.print / reduce / gather / gather_for_metrics / barriers, bound by the facade
    "stepping",  # the step's wiring behind px.backward / forward_backward / clip / accumulate
    "preparing",  # px.prepare's wiring: models, optimizers, schedulers, loaders
    "facade",  # `Phalanx`
    "config_command",  # `phalanx config`
    "cli",  # the `phalanx` command
    "__main__",
    "__init__",  # the public API
]


def _room(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else parts[0][:-3]


def _imports(path: Path) -> set[str]:
    """The phalanx rooms `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phalanx."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "phalanx":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("phalanx."))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"phalanx(\.\w+)+", node.value)
            and node.value.split(".")[1] in (*ORDER, *LEAVES)
        ):  # importlib.import_module("phalanx.x.y")
            found.add(node.value.split(".")[1])
    return found


@functools.lru_cache(maxsize=1)
def _graph() -> dict[str, dict[str, set[str]]]:
    """room -> imported room -> the files that import it."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        room = _room(path)
        for other in _imports(path) - {room}:
            graph.setdefault(room, {}).setdefault(other, set()).add(str(path.relative_to(SRC)))
    return graph


def test_every_room_has_a_place_in_the_order():
    rooms = {_room(path) for path in SRC.rglob("*.py")}
    assert rooms - LEAVES == set(ORDER), "place each new package or root module in ORDER (and docs/architecture.md)"


@pytest.mark.parametrize("room", ORDER)
def test_a_room_imports_only_the_rooms_before_it(room):
    allowed = set(ORDER[: ORDER.index(room)]) | LEAVES
    wrong = {other: sorted(files) for other, files in _graph().get(room, {}).items() if other not in allowed}
    assert not wrong, f"{room} imports rooms after it: {wrong}"


def test_the_leaves_import_no_room():
    graph = _graph()
    assert not {leaf: graph[leaf] for leaf in LEAVES if leaf in graph}


def test_no_cycles():
    graph = {room: set(edges) for room, edges in _graph().items()}
    done: set[str] = set()

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert room not in path, f"import cycle: {' -> '.join((*path, room))}"
        if room in done:
            return
        for other in sorted(graph.get(room, ())):
            visit(other, (*path, room))
        done.add(room)

    for room in sorted(graph):
        visit(room, ())


# strategies/ by concern, each room a subpackage: the plan's arithmetic (pure Python: the launcher and
# `phalanx plan` import it without torch), applying a plan (strategies/ itself and one package per
# dimension: context/, pipeline/, expert_parallel/), and the optimizers that step what it applied.
PLAN_ROOM = SRC / "strategies" / "plan"


def test_the_plan_room_imports_no_torch():
    modules = sorted(_module(path) for path in PLAN_ROOM.glob("*.py"))
    code = (
        f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\nassert not bad, bad[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# What each lower room of strategies/ may import from strategies/ besides itself: nothing that applies a plan
ROOM_DOORS = {
    # the pipeline's pure-Python schedule arithmetic (pipeline/__init__ loads it without torch)
    "plan": {"phalanx.strategies.pipeline", "phalanx.strategies.pipeline.schedules"},
    "optimizers": {"phalanx.strategies.plan", "phalanx.strategies.plan.parallel_plan"},
}


@pytest.mark.parametrize("room", sorted(ROOM_DOORS))
def test_a_lower_room_of_strategies_imports_nothing_that_applies_a_plan(room):
    modules = {_module(path) for path in SRC.rglob("*.py")}
    home = f"phalanx.strategies.{room}"
    wrong = {
        _module(path): sorted(
            m
            for m in _module_imports(path, modules) - ROOM_DOORS[room]
            if m.startswith("phalanx.strategies.") and not (m == home or m.startswith(home + "."))
        )
        for path in sorted((SRC / "strategies" / room).glob("*.py"))
    }
    assert not {m: found for m, found in wrong.items() if found}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The phalanx modules `path` imports, anywhere in the file (inside functions and TYPE_CHECKING
    blocks too, relative imports resolved, module names in strings included): `from a import b`
    is an edge to the module a.b when b is one, else to a."""
    this = _module(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            for alias in node.names:
                whole = f"{module}.{alias.name}"
                found.add(whole if whole in modules else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"phalanx(\.\w+)+", node.value)
        ):  # importlib.import_module("phalanx.x.y")
            found.add(node.value)
    return (found & modules) - {this}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for other in edges:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph[other]))))
                    break
                if other in on_stack:
                    low[node] = min(low[node], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules():
    """Inside a room too: no module imports, even lazily in a function, a module that imports it back.
    (A package's __init__ counts as the module named by the package.) Break a cycle by moving the shared
    piece into one of them or into a small module of its own, or by passing it in."""
    paths = sorted(SRC.rglob("*.py"))
    modules = {_module(path) for path in paths}
    graph = {_module(path): _module_imports(path, modules) for path in paths}
    cycles = [
        " | ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component)
        for component in _cycles(graph)
    ]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
