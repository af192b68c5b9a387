"""The rooms' doors: each package imports only the packages below it (checked on the source, so a
lazy import inside a function counts too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

# What each package may import from phalanx besides itself: the rooms below it.
BELOW: dict[str, set[str]] = {
    "config": set(),
    "model": {"config", "logging", "loop"},
    "loop": {"config", "logging"},
    "strategies": {"config", "logging", "loop", "model", "runtime"},
    "observe": {"config", "logging", "runtime"},  # runtime: start.py only (the launcher's side: no torch)
}


def _phalanx_imports(path: Path) -> set[str]:
    """The top-level phalanx packages `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phalanx."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "phalanx":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("phalanx."))
    return found


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_package_imports_only_the_rooms_below_it(package):
    wrong = {}
    for path in sorted((SRC / package).rglob("*.py")):
        above = _phalanx_imports(path) - BELOW[package] - {package, "envvars", "store_keys"}
        if above:
            wrong[str(path.relative_to(SRC))] = sorted(above)
    assert not wrong, f"{package}/ imports rooms above it: {wrong}"
