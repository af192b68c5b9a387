"""Which optimizer's state `phalanx plan` counts: the one the script builds, read from its source.

A training script passed as MODEL (`phalanx plan train.py`) usually builds its optimizer at module
level or in main(); its state is a third or more of the memory, so counting AdamW's two moments for
a script that runs SGD would be wrong by that much. The source is read, not run: a call to
`torch.optim.Adam(...)`, `optim.SGD(...)` or `AdamW(...)` names it. When the script builds none, or
several, the plan says which it assumed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

DEFAULT = "adamw"
# torch.optim class -> the name model/memory.py counts the state of
CLASSES: dict[str, str] = {"Adam": "adam", "AdamW": "adamw", "SGD": "sgd", "Adagrad": "adagrad", "RMSprop": "rmsprop"}


@dataclass(frozen=True)
class OptimizerChoice:
    name: str  # a key of model.memory.OPTIMIZER_STATES
    why: str  # how it was chosen, shown next to it


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _has_momentum(call: ast.Call) -> bool:
    """SGD keeps a momentum buffer unless momentum is absent or a literal 0."""
    for keyword in call.keywords:
        if keyword.arg == "momentum":
            return not (isinstance(keyword.value, ast.Constant) and keyword.value.value == 0)
    return len(call.args) >= 3  # SGD(params, lr, momentum, ...)


def optimizers_in(source: str) -> list[tuple[str, str]]:
    """(torch.optim class, plan name) for each optimizer the source constructs, in order, distinct."""
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _called_name(node) in CLASSES:
            cls = _called_name(node)
            name = CLASSES[cls]
            if name == "sgd" and _has_momentum(node):
                name = "sgd-momentum"
            if (cls, name) not in found:
                found.append((cls, name))
    return found


def choose(given: str | None, model_spec: str) -> OptimizerChoice:
    """--optimizer when given; else the one optimizer MODEL's file builds; else AdamW, said so."""
    if given:
        return OptimizerChoice(given, "--optimizer")
    target = model_spec.partition(":")[0]
    path = Path(target)
    if not (target.endswith(".py") and path.is_file()):
        return OptimizerChoice(DEFAULT, "assumed; --optimizer NAME sets it")
    try:
        found = optimizers_in(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        found = []  # importing it reports what is wrong with the file
    names = sorted({name for _, name in found})
    if len(names) == 1:
        classes = ", ".join(sorted({cls for cls, _ in found}))
        return OptimizerChoice(names[0], f"read from {path.name}: {classes}")
    if not names:
        return OptimizerChoice(
            DEFAULT, f"assumed: {path.name} builds no torch.optim optimizer plan knows; --optimizer NAME sets it"
        )
    listed = ", ".join(cls for cls, _ in found)
    return OptimizerChoice(DEFAULT, f"assumed: {path.name} builds several ({listed}); --optimizer NAME picks one")
