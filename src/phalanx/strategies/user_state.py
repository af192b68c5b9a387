"""`model.state_dict()` and `optimizer.state_dict()` as a script calls them on what px.prepare returned:
what one process would give, or refused at the call with the way (issue 51).

torch's tutorials save with `torch.save(model.state_dict(), path)` and resume with
`model.load_state_dict(torch.load(path))`. Where ranks hold parts of the model that file would be a
part that looks whole: zero2/zero3/hsdp and tensor parallel hold DTensor halves (a one-process
`load_state_dict` fails, "got mixed torch.Tensor and DTensor"), a pipeline rank holds its stage's
tensors only, and zero1's optimizer holds its rows of each state tensor. So on such a prepared model
and its optimizer:

- zero2/zero3/hsdp, tp: `state_dict()` gathers the full tensors on every rank (every rank calls it,
  as under DDP; called on some ranks only, it is refused after `AGREE_SECONDS` instead of waiting
  forever in the gather), and `load_state_dict` takes a full one, each rank keeping its own part (no
  collective). zero1's optimizer likewise.
- pp: `state_dict()` is refused, naming px.get_state_dict and px.save_state; `load_state_dict` of a
  full state loads this rank's stages' tensors.

phalanx's own checkpoints and torch's DCP (`get_model_state_dict`, `get_state_dict`) still read each
rank's part: the answers are instance attributes registered in torch's `_patched_state_dict`, the set
DCP consults to call the class's own `state_dict` instead (torch's `_patch_model_state_dict` uses it
the same way); tests/unit/test_user_state.py pins it to the installed torch. A parent module's
`state_dict(destination=, prefix=)` recursing into the model gets this rank's part too.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from phalanx.runtime.arrival import every_rank_called
from phalanx.strategies.plan.parallel_plan import ParallelPlan

AGREE_SECONDS = 60.0  # how long a rank calling state_dict() waits for the others to call it too
ANSWERS = ("state_dict", "load_state_dict")  # the instance attributes set here (a pickled model drops them)


def answer_model(model: nn.Module, plan: ParallelPlan, held_elsewhere: Callable[[str], bool], stages: str) -> None:
    """Give a prepared model whose ranks hold parts of it (`plan.shards_parameters`, pp > 1) the
    script's `state_dict()` and `load_state_dict(state)` (`held_elsewhere`: keys of other ranks' stages)."""
    layout = plan.describe()

    def state_dict(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # a parent's state_dict(destination, prefix, keep_vars) recursing: this rank's part
            return own(model, "state_dict", *args, **kwargs)
        if plan.pp > 1:
            raise ValueError(model_refusal(layout, stages))
        agree("model.state_dict", layout)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def load_state_dict(model: nn.Module, state: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        mine = own(model, "state_dict")  # this rank's parts: how each full tensor is laid out here
        parts = {k: local_part(v, mine.get(k)) for k, v in state.items() if not held_elsewhere(k)}
        return own(model, "load_state_dict", parts, strict=strict, assign=assign)

    answer(model, state_dict, load_state_dict)


def answer_wrapper(wrapper: nn.Module, inner: nn.Module) -> None:
    """torch's DDP around an answered module (tp or a pipeline stage with data-parallel replicas):
    its `state_dict()` is the module's answer under DDP's `module.` names, as DDP's own would be."""

    def state_dict(wrapper: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return own(wrapper, "state_dict", *args, **kwargs)
        return {f"module.{k}": v for k, v in inner.state_dict().items()}

    def load_state_dict(wrapper: nn.Module, state: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return inner.load_state_dict({k.removeprefix("module."): v for k, v in state.items()}, strict, assign)

    answer(wrapper, state_dict, load_state_dict)


def answer_optimizer(optimizer: torch.optim.Optimizer, plan: ParallelPlan) -> None:
    """Give a prepared optimizer whose ranks hold parts of its state (sharded parameters, zero1's
    rows, pp's stages) the script's `state_dict()` and `load_state_dict(state)`."""
    if not (plan.shards_parameters or plan.shards_optimizer_only or plan.pp > 1):
        return
    layout = plan.describe()

    def state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if plan.pp > 1:
            raise ValueError(optimizer_refusal(layout))
        agree("optimizer.state_dict", layout)
        return full_tensors(own(optimizer, "state_dict"))

    def load_state_dict(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        own(optimizer, "load_state_dict", state)
        for param, values in optimizer.state.items():  # a full state of a DTensor parameter: this rank's part
            for key, value in values.items():
                values[key] = local_part(value, param)

    answer(optimizer, state_dict, load_state_dict)


def answer(obj: Any, state_dict: Callable[..., Any], load_state_dict: Callable[..., Any]) -> None:
    """Give `obj` (a prepared model or optimizer) these `state_dict`/`load_state_dict`, called as
    `fn(obj, *args, **kwargs)`; torch's DCP keeps calling the class's own."""
    ref = weakref.ref(obj)
    for name, fn in zip(ANSWERS, (state_dict, load_state_dict)):
        bound = _Answer(ref, fn, name)
        obj.__dict__[name] = bound
        dcp_state_dict._patched_state_dict.add(bound)
        weakref.finalize(obj, dcp_state_dict._patched_state_dict.discard, bound)


class _Answer:
    """One answered method of one object (a weak reference to it: the object owns this)."""

    def __init__(self, ref: "weakref.ref[Any]", fn: Callable[..., Any], name: str):
        self._ref, self._fn, self.__name__ = ref, fn, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(self._ref(), *args, **kwargs)


def own(obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """The class's own method `name` on `obj` (this rank's part)."""
    return getattr(type(obj), name)(obj, *args, **kwargs)


def agree(what: str, layout: str) -> None:
    """Return once every rank called `what`; ValueError with the way if some rank did not."""
    every_rank_called(
        what,
        AGREE_SECONDS,
        lambda rank, absent: (
            f"phalanx: {what}() on rank {rank}: under {layout} the ranks hold parts of each tensor, so the full "
            f"state is gathered from every rank, but rank(s) {absent} did not call {what}() within "
            f"{AGREE_SECONDS:g} s. HINT: call {what}() on every rank (each gets the full state, as under DDP) and "
            "torch.save it on the main process only: state = model.state_dict(); "
            "if px.is_main_process: torch.save(state, path); or full = px.get_state_dict(model) on every rank"
        ),
    )


def full_tensors(state: Any) -> Any:
    """`state` (nested dicts and lists) with every DTensor gathered whole (a collective, in order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, dict):
        return {k: full_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_tensors(v) for v in state)
    return state


def local_part(value: Any, like: Any) -> Any:
    """A full tensor `value` laid out as the DTensor `like` is, each rank slicing its own part from
    its own copy (no collective); `value` itself where `like` is no DTensor or shapes differ."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(like.shape):
        return value
    return distribute_tensor(
        value.detach().to(like.device_mesh.device_type), like.device_mesh, like.placements, src_data_rank=None
    )


def model_refusal(layout: str, stages: str) -> str:
    """What `model.state_dict()` says where this rank holds pipeline stages only."""
    return (
        f"phalanx: model.state_dict() under {layout}: this rank holds pipeline stage(s) {stages} only, so a file "
        "of it would look like the whole model and hold part of it. HINT: full = px.get_state_dict(model) on "
        "every rank gives the whole model on the main process (if px.is_main_process: torch.save(full, path)); "
        "px.save_state(path) saves model and optimizer for resuming in any layout; "
        "model.load_state_dict(one_process_state) loads this rank's stages from a full state"
    )


def optimizer_refusal(layout: str) -> str:
    """What `optimizer.state_dict()` says where this rank's optimizer steps its pipeline stages only."""
    return (
        f"phalanx: optimizer.state_dict() under {layout}: this rank's optimizer holds its pipeline stages' "
        "parameters only, so a file of it would hold part of the state. HINT: px.save_state(path) saves "
        "the model and optimizer of every stage, and px.load_state(path) resumes them in any layout"
    )
