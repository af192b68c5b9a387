"""`copy.deepcopy` of a model sharded by FSDP2 (zero2/zero3/hsdp): a working, equally sharded copy.

torch's idioms copy the model: `torch.optim.swa_utils.AveragedModel(model)` (EMA, SWA) deep-copies
it and averages `zip(copy.parameters(), model.parameters())`. FSDP2 refuses the copy outright ("FSDP
does not support deepcopy"): its state holds process groups and hooks bound to the original. Here
the copy is made of the module alone (full weights gathered, FSDP's classes and hooks left out) and
sharded again as `apply` sharded the model: the same units, mesh and policies, so its parameters are
DTensors laid out as the model's, the average runs shard by shard and `copy(x)` gathers as the model does.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

from torch import nn

from phalanx.strategies.user_state import ANSWERS

# model -> how to shard a plain copy of it again (recorded by fsdp.apply)
_RESHARD: "weakref.WeakKeyDictionary[nn.Module, Callable[[nn.Module], None]]" = weakref.WeakKeyDictionary()


def remember(
    model: nn.Module,
    units: list[nn.Module],
    reshard: list[bool],
    kwargs: dict[str, Any],
    after: Callable[[list[nn.Module], list[nn.Module]], None],
) -> None:
    """Record how `apply` sharded `model` (its units by name, each unit's reshard_after_forward, the
    fully_shard keywords, `after(units, roots)` for what follows), for `deepcopy_sharded`."""
    names = {id(m): n for n, m in model.named_modules()}
    unit_names = [names[id(u)] for u in units]

    def reshard_copy(plain: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        copies = [plain.get_submodule(n) for n in unit_names]
        for unit, again in reversed(list(zip(copies, reshard))):  # inner units first, as apply
            fully_shard(unit, reshard_after_forward=again, **kwargs)
        fully_shard(plain, reshard_after_forward=False, **kwargs)
        after(copies, [plain])

    _RESHARD[model] = reshard_copy


def refusal(layout: str) -> str:
    """What `copy.deepcopy(model)` says where the layout cannot be copied and sharded again."""
    return (
        f"copy.deepcopy(model) (e.g. torch's AveragedModel for EMA/SWA): under {layout} phalanx copies only a "
        "model FSDP alone sharded (zero2, zero3, hsdp without tp, pipeline or row-sharded embeddings); this "
        "one is also split by tensor parallel, pipeline stages or sharded embedding rows. HINT: keep the "
        "average of px.get_state_dict(model) yourself, or use zero2/zero3/hsdp without tp and pp "
        "(embedding_exchange='params') for AveragedModel"
    )


def can_copy(model: nn.Module) -> bool:
    return model in _RESHARD


def deepcopy_sharded(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A copy of `model` sharded as it is (collective: every rank copies, as every rank prepared)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    classes = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in memo:  # the full weights, plain: fully_shard cuts them again
                full = p.full_tensor() if isinstance(p, DTensor) else p
                memo[id(p)] = nn.Parameter(full.detach().clone(), requires_grad=p.requires_grad)
        for name, value in vars(m).items():  # FSDP's hooks and state (and hooks bound to this model) stay behind
            if isinstance(value, dict) and ("hooks" in name or name in (STATE_KEY, REGISTRY_KEY)):
                memo[id(value)] = type(value)()
        if isinstance(m, FSDPModule):
            classes[m] = type(m)
    # the model's own state_dict answers (user_state.py) are bound to it: the copy keeps its class's
    answers = {k: model.__dict__.pop(k) for k in ANSWERS if k in model.__dict__}
    try:
        for m, cls in classes.items():  # the user's own class: FSDP's refuses deepcopy
            m.__class__ = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        plain = copy.deepcopy(model, memo)
    finally:
        for m, cls in classes.items():
            m.__class__ = cls
        model.__dict__.update(answers)
    _RESHARD[model](plain)
    return plain
