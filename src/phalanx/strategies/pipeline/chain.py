"""The chain of units a pipeline can cut a model into, found from the model itself.

A stack-shaped model (embedding, a list of blocks, norm, head) whose `forward` only calls its
modules one after another (`x = self.embed(x); for block in self.layers: x = block(x); ...`) can be
cut into stages by replacing the modules a stage does not own with pass-throughs: the user's
`forward` then runs unchanged on every stage and parameter names stay the model's own. This module
finds the blocks (the model's largest `nn.ModuleList` / `nn.Sequential` by parameter count), the
units around them (the other children of the block list's ancestors), and checks with torch.fx
that the forward is such a plain chain: each unit called once, on the previous unit's output alone,
nothing computed in between. What it cannot cut, it refuses with the reason.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import fx, nn

_LISTS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class Unit:
    """One module of the chain: a block of the block list, or a module before or after it."""

    name: str
    """its name in the model (`layers.3`, `embed`)."""
    num_params: int
    is_block: bool


@dataclass(frozen=True)
class ModelChain:
    """The units of a model in the order its forward calls them."""

    units: tuple[Unit, ...]
    blocks: str
    """the block list's name in the model ("" when the model itself is the list)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    @property
    def num_blocks(self) -> int:
        return sum(u.is_block for u in self.units)

    def describe(self) -> str:
        """The unit names, with a long run of blocks shortened (`embed, layers.0 ... layers.31, head`)."""
        names = list(self.names)
        blocks = [n for n, u in zip(names, self.units) if u.is_block]
        if len(blocks) > 4:
            start, end = names.index(blocks[0]), names.index(blocks[-1])
            names[start : end + 1] = [f"{blocks[0]} ... {blocks[-1]}"]
        return ", ".join(names)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_list(model: nn.Module) -> str:
    """The name of the model's largest ModuleList/Sequential by parameter count (the outermost of
    equals); "" for the model itself."""
    best: tuple[int, int, str] | None = None  # (-params, depth, name)
    for name, module in model.named_modules():
        if isinstance(module, _LISTS) and len(module) > 0:
            key = (-_num_params(module), name.count(".") + bool(name), name)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: it has no nn.ModuleList or "
            "nn.Sequential of blocks, and pp_split cannot help: it chooses where to cut among the blocks of "
            "such a list. HINT: hold the repeated blocks in an nn.ModuleList and call them in a loop in forward "
            "(or in order through an nn.Sequential)."
        )
    return best[2]


def _unit_names(model: nn.Module, blocks: str) -> tuple[list[str], set[str]]:
    """The block names, and the names of the other children of the block list's ancestors."""
    container = model.get_submodule(blocks)
    prefix = f"{blocks}." if blocks else ""
    block_names = [f"{prefix}{child}" for child, _ in container.named_children()]
    others: set[str] = set()
    path = blocks.split(".") if blocks else []
    parent = ""
    for part in path:
        module = model.get_submodule(parent)
        for child, _ in module.named_children():
            if child != part:
                others.add(f"{parent}.{child}" if parent else child)
        parent = f"{parent}.{part}" if parent else part
    return block_names, others


class _UnitTracer(fx.Tracer):
    """Traces the forward down to the units, which stay opaque calls."""

    def __init__(self, units: set[str]):
        super().__init__()
        self.units = units

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.units


def _trace(model: nn.Module, units: set[str]) -> fx.Graph:
    params = list(inspect.signature(model.forward).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: its forward takes no "
            "positional input (the pipeline feeds the first stage one tensor)."
        )
    required = [p.name for p in positional[1:] if p.default is p.empty]
    if required:
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: its forward needs more than one "
            f"input ({positional[0].name}, {', '.join(required)}), and a pipeline passes one tensor from "
            "stage to stage. HINT: give the other arguments defaults, or fold them into the first input."
        )
    concrete = {p.name: p.default for p in params[1:] if p.default is not p.empty}
    try:
        return _UnitTracer(units).trace(model, concrete_args=concrete or None)
    except Exception as e:  # fx's errors (TraceError, a Proxy in a condition...) say what it met
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: its forward could not be traced to "
            f"check that it calls its modules as a plain chain ({type(e).__name__}: {e}). HINT: keep data-"
            "dependent control flow inside the blocks, whose forward is not traced."
        ) from e


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} `{target}`"


def _chain_calls(model: nn.Module, graph: fx.Graph, units: set[str]) -> list[str]:
    """The units in call order; refuses any other computation on the data path."""
    name = type(model).__name__
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    current = placeholders[0]
    on_path = {current}
    calls: list[str] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inputs = set(node.all_input_nodes)
        if node.op not in ("call_module", "get_attr") and not inputs & on_path:
            continue  # fx's guards on the defaults of other arguments: not on the data path
        on_path.add(node)
        if node.op == "call_module" and node.target in units:
            if node.target in calls:
                raise ValueError(
                    f"cannot cut {name} into pipeline stages: its forward calls `{node.target}` more than "
                    "once; a module called twice cannot live on one stage only."
                )
            if node.args != (current,) or node.kwargs:
                given = ", ".join([str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()])
                raise ValueError(
                    f"cannot cut {name} into pipeline stages: its forward calls `{node.target}` on ({given}), "
                    f"not on the previous unit's output `{current}` alone; each unit must take only that. HINT: "
                    "pass extra values through the hidden state or keep them inside the blocks."
                )
            calls.append(str(node.target))
            current = node
            continue
        after = f" after `{current.target}`" if current.op == "call_module" else " on the input"
        hint = (
            "a block that returns a tuple is unpacked in forward; the pipeline sends one tensor between "
            "stages, so the blocks must return the hidden state alone"
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"
            else "move that computation into a module (e.g. the embedding's or the head's forward)"
        )
        raise ValueError(
            f"cannot cut {name} into pipeline stages: its forward computes {_describe(node)}{after}, which "
            "is not a call of one of its units on the previous output. Stages are cut by replacing the units "
            f"a stage does not own with pass-throughs, which keeps the forward unchanged only for a plain "
            f"chain of calls. HINT: {hint}."
        )
    output = next(n for n in graph.nodes if n.op == "output")
    if output.args[0] is not current:
        raise ValueError(
            f"cannot cut {name} into pipeline stages: its forward does not return the last "
            "unit's output alone (the last stage's output is what the loss receives)."
        )
    return calls


def find_chain(model: nn.Module) -> ModelChain:
    """The model's units in call order; refuses, with the reason, a model this cut cannot handle."""
    blocks = block_list(model)
    block_names, others = _unit_names(model, blocks)
    units = set(block_names) | others
    calls = _chain_calls(model, _trace(model, units), units)
    missing = [n for n in sorted(units - set(calls)) if _num_params(model.get_submodule(n))]
    if missing:
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: {', '.join(missing)} hold(s) "
            "parameters but the forward never calls them, so no stage would train them. HINT: remove "
            "unused modules from the model."
        )
    block_set = set(block_names)
    return ModelChain(
        units=tuple(Unit(n, _num_params(model.get_submodule(n)), n in block_set) for n in calls),
        blocks=blocks,
    )


def shared_parameters(model: nn.Module, chain: ModelChain) -> dict[str, list[str]]:
    """Parameters that more than one unit holds (tied weights): parameter name -> the units."""
    owners: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for unit in chain.names:
        for pname, p in model.get_submodule(unit).named_parameters():
            owners.setdefault(id(p), [])
            if unit not in owners[id(p)]:
                owners[id(p)].append(unit)
            names.setdefault(id(p), f"{unit}.{pname}")
    return {names[k]: v for k, v in owners.items() if len(v) > 1}
