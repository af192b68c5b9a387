"""Tied parameters (one parameter held by several modules: tied input/output embeddings, any
user-tied weights) stay one parameter with one gradient under tensor parallel.

torch's `parallelize_module` replaces each module's parameters by new DTensor ones, so two modules
holding one parameter would end up with two diverging copies. Here the tied modules get compatible
placements before the split (an output projection split by vocabulary rows, colwise, ties to an
embedding split by rows too, `embedding_rowwise`: both Shard(0)); a tie no split can keep gets both
modules replicated; after the split every holder is pointed at one parameter again.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

Holder = tuple[str, str]  # (module name, parameter attribute)

# styles that split a weight by its rows (dim 0), per module kind
_ROWS_LINEAR = ("colwise", "colwise_gather_output")
_ROWS_EMBEDDING = ("embedding_rowwise", "rowwise", "rowwise_split_input")
_WHOLE = ("replicate", "replicated_with_grad_allreduce", "local", None)


def tied_groups(model: nn.Module) -> list[list[Holder]]:
    """Each parameter held by more than one module: its holders, in registration order."""
    holders: dict[int, list[Holder]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), [])
            if (name, pname) not in holders[id(param)]:
                holders[id(param)].append((name, pname))
    return [h for h in holders.values() if len(h) > 1]


def _splits_rows(module: nn.Module, style: str | None) -> bool | None:
    """True: the style splits the module's weight by rows; None: leaves it whole; False: otherwise."""
    if style in _WHOLE:
        return None
    if isinstance(module, nn.Embedding):
        return style in _ROWS_EMBEDDING
    return isinstance(module, nn.Linear) and style in _ROWS_LINEAR


def compatible_styles(model: nn.Module, chosen: Mapping[str, str], groups: list[list[Holder]]) -> dict[str, str]:
    """`chosen` (module name -> style) with every tie given placements that keep it one parameter:
    the holders of a weight split by rows all split by rows, else all replicated."""
    out = dict(chosen)
    modules = dict(model.named_modules())
    for group in groups:
        if any(pname != "weight" for _, pname in group):
            kinds = {None}
        else:
            kinds = {_splits_rows(modules[name], out.get(name)) for name, _ in group}
        if kinds == {None}:
            continue  # every holder whole: replicated alike
        if False not in kinds and all(isinstance(modules[n], (nn.Embedding, nn.Linear)) for n, _ in group):
            for name, _ in group:  # the whole ones split by rows too
                if out.get(name) in _WHOLE:
                    out[name] = (
                        "embedding_rowwise" if isinstance(modules[name], nn.Embedding) else "colwise_gather_output"
                    )
            continue
        for name, _ in group:
            out[name] = "replicate"
    return out


def retie(model: nn.Module, groups: list[list[Holder]]) -> None:
    """Point every holder of each group at the first holder's (now laid out) parameter."""
    for group in groups:
        first, fname = group[0]
        param = getattr(model.get_submodule(first), fname)
        for name, pname in group[1:]:
            setattr(model.get_submodule(name), pname, param)
