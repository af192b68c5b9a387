"""`model.module` on a prepared model, in every layout.

Scripts written for DDP save with `torch.save(model.module.state_dict(), ...)` on rank 0. Under
ddp and dp the prepared model is torch's wrapper and `.module` is the user's module, as ever. In
every other layout the model is the user's module itself, laid out in place, and `.module` raises
a message naming `px.get_state_dict(model)` and `px.unwrap_model(model)` instead of a bare
AttributeError: sharded (zero2/zero3/hsdp), split by tensor parallel or cut into pipeline stages,
it holds this rank's part only (its `state_dict()` gathers the whole model, or is refused under
pp: strategies/user_state.py). The model also answers DDP's `no_sync()` where its class has none.

It stays an AttributeError, so `hasattr(model, "module")` is False and code that unwraps "if it has
a .module" (transformers' unwrap_model, `getattr(model, "module", model)`) keeps working; a
`.module` that returned the model itself would send such loops round forever. The model's class
becomes a subclass of its own class (as FSDP2's `fully_shard` does) that answers only that name.
"""

from __future__ import annotations

import contextlib
import copyreg
import weakref
from typing import Any, Callable, ContextManager

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from phalanx.checkpoint.save_pretrained import save_full
from phalanx.strategies import fsdp_copy, user_state

_SUBCLASSES: dict[type, type] = {}
# model -> its full weights, gathered by every rank (a model holding part of them only): its
# save_pretrained writes those. Kept outside the model, which torch.save and deepcopy must copy.
_FULL_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, Callable[[], dict]]" = weakref.WeakKeyDictionary()
# model -> its `no_sync()` in its layout: DDP's documented accumulation (`with model.no_sync():`)
_NO_SYNC: "weakref.WeakKeyDictionary[nn.Module, Callable[[], ContextManager[None]]]" = weakref.WeakKeyDictionary()


def module_message(layout: str, holds_part: bool) -> str:
    """What `model.module` says under `layout` (e.g. "zero3 (dp_shard=2)")."""
    if holds_part:
        what = (
            "it holds this rank's part only, not the whole model (its state_dict() gathers the whole model on "
            "every rank; under pp it is refused). HINT: state = model.state_dict() on every rank, or "
            "px.get_state_dict(model), gives the full weights (save those from rank 0 with torch.save)"
        )
    else:
        what = (
            "its state_dict() is the whole model. HINT: px.get_state_dict(model) gives the full weights in every layout"
        )
    return (
        f"model.module: under {layout} the prepared model is your own module, laid out in place (no DDP wrapper "
        f"holds it); {what}, px.unwrap_model(model) gives the module itself"
    )


def answer_module_attribute(
    model: nn.Module,
    layout: str,
    holds_part: bool,
    full_weights: Callable[[], dict] | None = None,
    no_sync: Callable[[], ContextManager[None]] | None = None,
) -> nn.Module:
    """Make `model.module` raise `module_message` (nothing changes if `model` has a `.module`; a
    model prepared again keeps its class and gets the new layout's message). `full_weights`
    (where `holds_part`): gathers the full weights; a `save_pretrained` of the model's writes them.
    `no_sync`: the layout's gradient-sync pause, the model's `no_sync()` (where its class has none)."""
    wrapped = model.module if isinstance(model, (DistributedDataParallel, DataParallel)) else None
    if holds_part and full_weights is not None:
        _FULL_WEIGHTS[model if wrapped is None else wrapped] = full_weights
        if wrapped is not None:  # ep under DDP: the module DDP wraps holds this rank's experts only
            _answer(wrapped, f"{type(wrapped).__name__!r} object has no attribute 'module'", layout)
    if no_sync is not None:
        _NO_SYNC[model] = no_sync
    if hasattr(model, "module"):  # torch's DDP / DataParallel, or the user's own submodule of that name
        return model
    _answer(model, module_message(layout, holds_part), layout)
    return model


def _answer(model: nn.Module, message: str, layout: str) -> None:
    """Give `model` the answering subclass of its class (once): `.module` raises `message`, and
    its save_pretrained writes the full weights where `_FULL_WEIGHTS` holds them."""
    cls = type(model)
    if cls not in _SUBCLASSES.values():
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = _answering_subclass(cls)
        model.__class__ = _SUBCLASSES[cls]
    model._phalanx_module_message = message  # type: ignore[assignment]
    model._phalanx_layout = layout  # type: ignore[assignment]


def _answering_subclass(base: type) -> type:
    """`base` with a `__getattr__` that answers `.module`; its methods call `base`'s by name (not
    `super(type(self), self)`, which recurses as soon as the class is subclassed again)."""

    def __getattr__(self: nn.Module, name: str) -> Any:
        try:
            return base.__getattr__(self, name)
        except AttributeError:
            if name == "module":
                raise AttributeError(self.__dict__["_phalanx_module_message"]) from None
            raise

    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        """Pickled (torch.save(model), deepcopy) as `base`: this class exists only in this process."""
        reduced = base.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1] and reduced[1][0] is type(self):
            # object.__new__(base), then the same state: stdlib only, so loading needs no phalanx
            reduced = (copyreg._reconstructor, (base, object, None), *reduced[2:])
        if isinstance(reduced, tuple) and len(reduced) >= 3 and isinstance(reduced[2], dict):
            state = {k: v for k, v in reduced[2].items() if k not in user_state.ANSWERS}  # bound to this model
            reduced = (*reduced[:2], state, *reduced[3:])
        return reduced

    members: dict[str, Any] = {
        "__getattr__": __getattr__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    if callable(getattr(base, "__deepcopy__", None)):  # FSDP2's refuses; AveragedModel (EMA) deep-copies

        def __deepcopy__(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
            """A working copy sharded as the model is (strategies/fsdp_copy.py)."""
            if fsdp_copy.can_copy(self):
                return fsdp_copy.deepcopy_sharded(self, memo)
            raise ValueError(fsdp_copy.refusal(self.__dict__["_phalanx_layout"]))

        members["__deepcopy__"] = __deepcopy__
    if callable(getattr(base, "save_pretrained", None)):

        def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            """transformers' save_pretrained; where this rank holds part of the weights, every rank
            calls it and the main process writes the full model (checkpoint/save_pretrained.py)."""
            full = _FULL_WEIGHTS.get(self)
            if full is None:
                return base.save_pretrained(self, save_directory, *args, **kwargs)
            return save_full(lambda *a, **k: base.save_pretrained(self, *a, **k), full, save_directory, *args, **kwargs)

        members["save_pretrained"] = save_pretrained
    if not callable(getattr(base, "no_sync", None)):

        def no_sync(self: nn.Module) -> ContextManager[None]:
            """DDP's `with model.no_sync():` accumulation in this layout: FSDP2's gradient sync paused
            (zero2/zero3/hsdp), nothing under tensor or pipeline parallel alone (nothing to sync, or
            the pipeline syncs once per step)."""
            pause = _NO_SYNC.get(self)
            return pause() if pause is not None else contextlib.nullcontext()

        members["no_sync"] = no_sync
    return type(base.__name__, (base,), members)
