"""The random numbers a model built under `px.init_module()` would have drawn in one process.

On the meta device a construction draws nothing: transformers' constructors (every Linear's
kaiming draw, then `post_init`'s `_init_weights`), then peft's adapters (LoRA's A by kaiming), all
run on tensors without storage. Materialising module by module afterwards (meta_init.py) draws
other numbers: other calls (a LoRA A initialised by the base model's `_init_weights`) from another
point of the generator's stream (the constructors' draws never happened), so a LoRA run under
zero3 started from another adapter than one process's (eval loss 6.1560 against 6.1520).

So while a model is built on meta, `Recorder` (a TorchFunctionMode) notes for each parameter and
buffer the last call that overwrote it whole (torch.nn.init's and Tensor's random fills with the
generator state before them, the constant fills) and consumes the generator as the call would have
on a real tensor of that size (drawn into a throwaway, one tensor at a time): the generator leaves
the construction where one process's does. Materialising, `Pinning` answers each random fill of a
module's full-size stand-in with that tensor's recorded last call, from its recorded state, so
every tensor gets one process's numbers whatever order the modules are materialised in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# torch.nn.init's, Tensor's and transformers.initialization's (its guarded copies of torch's) in-place
# fills, by name: the outermost call is the one seen (a mode is off inside its own handler)
RANDOM = {
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "sparse_",
    "lecun_normal_",
    "default_flax_embed_init_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
}
FILLS = {"zeros_", "ones_", "constant_", "eye_", "dirac_", "zero_", "fill_"}
FLAGS = {"requires_grad_", "share_memory_"}  # in place, but not on the values
_DATA = torch.Tensor.data  # `param.data`: an alias the init functions are often given


def _is_data(func: Any) -> bool:
    return getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) is _DATA


@dataclass(frozen=True)
class Fill:
    """The last call that overwrote a tensor whole: `func(tensor, *args, **kwargs)`, from the
    generator state `state` (None: it draws nothing)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: torch.Tensor | None

    def apply(self, tensor: torch.Tensor) -> None:
        if self.state is None:
            self.func(tensor, *self.args, **self.kwargs)
            return
        # drawn on the CPU from the CPU generator, as recorded (an accelerator's tensor gets a copy)
        drawn = (
            tensor
            if tensor.device.type == "cpu"
            else torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu")
        )
        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            self.func(drawn, *self.args, **self.kwargs)
        finally:
            torch.set_rng_state(saved)
        if drawn is not tensor:
            tensor.copy_(drawn)


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("tensor")


def _rest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments after the tensor, when none of them is a meta tensor (else None: not replayable)."""
    rest, named = args[1:], {k: v for k, v in kwargs.items() if k != "tensor"}
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in (*rest, *named.values())):
        return None  # type: ignore[return-value]
    return rest, named


class Recorder(TorchFunctionMode):
    """Inside `px.init_module()` on meta: each meta tensor's last whole overwrite, the generator
    consumed as on real tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[int, Fill | None] = {}  # id(tensor) -> its last whole overwrite (None: not replayable)
        self.keep: dict[int, torch.Tensor] = {}  # the tensors noted (their ids stay theirs)
        self.alias: dict[int, torch.Tensor] = {}  # id(param.data) -> param
        self.restore: Callable[[], None] | None = None  # undoes the patch below, once made

    def _patch_transformers(self) -> None:
        """transformers' `post_init` skips `initialize_weights` on meta (nothing to fill): run it there
        too, so that the draws one process makes at that point are seen. Patched once transformers is
        imported (a script may import it inside the block), until the block ends."""
        modeling = sys.modules.get("transformers.modeling_utils")
        model_class = getattr(modeling, "PreTrainedModel", None)
        if model_class is None:
            return
        original = model_class.init_weights

        def init_weights(self: Any) -> None:  # transformers' own, less its "not on meta" condition
            self.initialize_weights()
            self.tie_weights(recompute_mapping=False)

        model_class.init_weights = init_weights
        self.restore = lambda: setattr(model_class, "init_weights", original)

    def unpatch(self) -> None:
        if self.restore is not None:
            self.restore()
            self.restore = lambda: None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.restore is None:
            self._patch_transformers()
        if _is_data(func):
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_meta:
                self.alias[id(out)] = self.alias.get(id(args[0]), args[0])
            return out
        target = _target(args, kwargs)
        name = getattr(func, "__name__", "")
        if (
            not (isinstance(target, torch.Tensor) and target.is_meta and name.endswith("_"))
            or name in FLAGS
            or name.startswith("__")
        ):
            return func(*args, **kwargs)
        base = self.alias.get(id(target), target)
        whole = tuple(target.shape) == tuple(base.shape)
        rest = _rest(args, kwargs)
        if name in RANDOM:
            state = torch.get_rng_state()
            if rest is not None:  # consume the generator as this call does on a real tensor
                throwaway = torch.empty(tuple(target.shape), dtype=target.dtype, device="cpu")
                func(throwaway, *rest[0], **rest[1])
                del throwaway
            fill = Fill(func, *rest, state) if rest is not None and whole else None
        elif name in FILLS:
            fill = Fill(func, *rest, None) if rest is not None and whole else None
        else:  # another in-place write (copy_ of a computed value): left to the module's own init
            fill = None
        if whole:  # a part written after (an embedding's padding row) is written again by the module's init
            self.last[id(base)] = fill
            self.keep[id(base)] = base
        return func(*args, **kwargs)


_recordings: list[Recorder] = []  # every init_module's (their meta tensors only: no memory)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Note the whole overwrites of the meta tensors built inside (see `Recorder`)."""
    recorder = Recorder()
    _recordings.append(recorder)
    try:
        with recorder:
            yield
    finally:
        recorder.unpatch()


def recorded_fills(model: nn.Module) -> dict[tuple[int, str], Fill]:
    """(id(module), tensor name) -> the recorded last whole overwrite of that module's own tensor, for
    `model`'s modules (taken before a strategy replaces its tensors by shards), in module order."""
    found: dict[tuple[int, str], Fill] = {}
    if not _recordings:
        return found
    for module in model.modules():
        own = {**module._parameters, **module._buffers}
        for name, tensor in own.items():
            for recorder in _recordings:
                fill = recorder.last.get(id(tensor)) if tensor is not None else None
                if fill is not None and recorder.keep.get(id(tensor)) is tensor:
                    found[(id(module), name)] = fill
    return found


def same_on_every_rank(fills: dict[tuple[int, str], Fill]) -> dict[tuple[int, str], Fill]:
    """`fills` with rank 0's generator states (ranks seeded apart still build one model)."""
    import torch.distributed as dist

    if not fills or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fills
    states = [fill.state for fill in fills.values()]
    dist.broadcast_object_list(states, src=0)
    return {key: dataclasses.replace(fill, state=state) for (key, fill), state in zip(fills.items(), states)}


class Pinning(TorchFunctionMode):
    """While a module initialises its full-size stand-ins: a random fill of one with a recorded
    last overwrite runs that overwrite instead, from its recorded generator state."""

    def __init__(self, pinned: dict[int, Fill]):
        super().__init__()
        self.pinned = pinned  # id(stand-in) -> its tensor's recorded overwrite
        self.alias: dict[int, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_data(func):
            out = func(*args, **kwargs)
            self.alias[id(out)] = self.alias.get(id(args[0]), id(args[0]))
            return out
        if getattr(func, "__name__", "") in RANDOM:
            target = _target(args, kwargs)
            key = self.alias.get(id(target), id(target))
            fill = self.pinned.get(key)
            if fill is not None and isinstance(target, torch.Tensor):
                fill.apply(target)
                return target
        return func(*args, **kwargs)
