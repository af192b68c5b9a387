"""Models built on the meta device: never materialise the whole model on one rank.

`init_module(sharded, device)` is the context a script builds its model in (meta for zero2/zero3,
the device otherwise). After a strategy has sharded a meta model, `materialize` allocates only the
local shards on the device and initialises them module by module: each module that owns
parameters or buffers gets a full-size temporary copy of *its own* tensors (one module at a time,
never the model), runs its `reset_parameters()` (or the user's `init_weights(module)`) on it, and
keeps this rank's slice. The random draws therefore happen in the same order and from the same
generator as a normal construction: with the same seed the weights equal a model built normally
(DTensor's own RNG cannot do that on CPU, where it is unsupported and every rank would draw the
same values for its different slice).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from phalanx.model import init_replay
from phalanx.model.init_replay import Fill

InitFn = Callable[[nn.Module], None]


def is_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of `model` lives on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


@contextlib.contextmanager
def init_module(sharded: bool, device: torch.device) -> Iterator[None]:
    """Build modules on the meta device (`sharded`: zero2/zero3; prepare allocates only the shards)
    or directly on `device` (replicated strategies: no copy from host memory afterwards)."""
    if not sharded:
        with torch.device(device):
            yield
        return
    # the generator consumed and each tensor's last overwrite noted, as one process draws (init_replay.py)
    with init_replay.recording(), torch.device("meta"):
        yield


def transformers_init(model: nn.Module, cut_away: Iterable[nn.Module] = ()) -> InitFn | None:
    """For models holding a transformers `PreTrainedModel` (also inside a peft wrapper): each module
    inside one is initialised by that model's own `_init_weights(module)` (its norms and rotary
    buffers have no reset_parameters); modules outside any use reset_parameters(). None otherwise.
    `cut_away`: modules a pipeline cut took out of the model, which were inside its outermost one."""
    owners = [m for m in model.modules() if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")]
    if not owners:
        return None
    owner_of: dict[int, nn.Module] = {id(m): owners[0] for m in cut_away}
    for owner in owners:  # in module order: an inner model overrides the outer one for its modules
        for module in owner.modules():
            owner_of[id(module)] = owner

    def init(module: nn.Module) -> None:
        owner = owner_of.get(id(module))
        if owner is not None:
            owner._init_weights(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        else:
            raise ValueError(
                f"initialising a meta-device model: {type(module).__name__} has no reset_parameters() "
                "and is outside the transformers model. HINT: pass strategy_options={'init_weights': fn}"
            )

    return init


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def check_initialisable(model: nn.Module, init_fn: InitFn | None) -> None:
    """Refuse, naming them, modules with their own meta tensors and no way to initialise them."""
    if init_fn is not None:
        return
    lacking = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if _owns_state(m)
        and any(t.is_meta for t in _own_tensors(m))
        and not callable(getattr(m, "reset_parameters", None))
    ]
    if lacking:
        raise ValueError(
            "the model was built on the meta device, but these modules hold parameters or buffers and "
            f"have no reset_parameters() to initialise them: {', '.join(lacking)}. HINT: give them a "
            "reset_parameters() method, or pass strategy_options={'init_weights': fn} with fn(module) "
            "initialising a module's own tensors, or build the model off the meta device."
        )


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _full_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A full-size stand-in; floating ones start as NaN so that a value init left alone shows."""
    full = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
    return full.fill_(float("nan")) if full.is_floating_point() else full


def local_index(target: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's part of a DTensor in the full tensor (any mesh and placements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` for a DTensor `target` (the whole of it for a plain tensor): a
    view, no copy."""
    from torch.distributed.tensor import DTensor

    return full[local_index(target)] if isinstance(target, DTensor) else full


@torch.no_grad()
def _init_one(
    module: nn.Module, init_fn: InitFn | None, device: torch.device, fills: dict[tuple[int, str], Fill]
) -> None:
    params = dict(module.named_parameters(recurse=False))
    buffers = dict(module.named_buffers(recurse=False))
    temps = {name: nn.Parameter(_full_like(p, device), requires_grad=p.requires_grad) for name, p in params.items()}
    temp_buffers = {name: _full_like(b, device) for name, b in buffers.items() if b is not None}
    for name, t in temps.items():  # swap in full-size stand-ins; the shards stay aside
        module._parameters[name] = t
    for name, t in temp_buffers.items():
        module._buffers[name] = t
    pinned = {
        id(t): fills[(id(module), name)] for name, t in {**temps, **temp_buffers}.items() if (id(module), name) in fills
    }
    try:
        with init_replay.Pinning(pinned) if pinned else contextlib.nullcontext():
            if init_fn is not None:
                init_fn(module)
            else:
                module.reset_parameters()
        drawn = {**{n: module._parameters[n] for n in temps}, **{n: module._buffers[n] for n in temp_buffers}}
    finally:
        for name, p in params.items():
            module._parameters[name] = p
        for name in temp_buffers:
            module._buffers[name] = buffers[name]
    untouched = [n for n, t in drawn.items() if _has_nan(t)]  # the full tensors: every rank agrees
    if untouched:
        how = "init_weights" if init_fn is not None else f"{type(module).__name__}.reset_parameters()"
        raise ValueError(
            f"initialising a meta-device model: {how} left {', '.join(untouched)} of this "
            f"{type(module).__name__} (wholly or partly) unset. HINT: initialise every parameter and "
            "buffer the module owns there, or build the model off the meta device."
        )
    for name, target in {**params, **{n: buffers[n] for n in temp_buffers}}.items():
        _local(target).copy_(_local_slice(drawn[name].detach(), target))


def _has_nan(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """NaN anywhere in `t`, checked a chunk at a time (no full-size mask next to a large shard)."""
    if not t.is_floating_point():
        return False
    flat = t.detach().reshape(-1)
    return any(bool(torch.isnan(part).any()) for part in flat.split(chunk))


def sync_rng_from_rank0(device: torch.device) -> None:
    """Every rank draws initial weights from rank 0's generator state (CPU, and the accelerator's),
    so their slices come from one model, as DTensor's RNG tracker does on GPUs; ranks seeded alike
    are unchanged by this."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    accelerator = getattr(torch, device.type) if device.type != "cpu" else None
    states = [torch.get_rng_state(), accelerator.get_rng_state() if accelerator is not None else None]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])
    if accelerator is not None:
        accelerator.set_rng_state(states[1])


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def materialize(
    model: nn.Module,
    device: torch.device,
    init_fn: InitFn | None = None,
    param_device: torch.device | None = None,
    order: Sequence[nn.Module] | None = None,
    roots: Sequence[nn.Module] | None = None,
    fills: dict[tuple[int, str], Fill] | None = None,
) -> None:
    """Allocate `model`'s meta tensors on `device` (only the local shards of sharded parameters)
    and initialise them per module, in registration order, as a normal construction would.
    `param_device`: where parameters live when not on `device` (CPU offload); buffers stay on `device`.
    `order`: a pipeline stage's model, cut from a whole one: the whole model's modules in registration
    order, taken before the cut. The modules cut away (still on meta) are initialised too, one at a
    time, and thrown away, so this stage's modules draw the random numbers they draw in one process.
    `roots`: the modules to allocate through, which together hold all of `model`'s tensors (default:
    `model`): FSDP2 re-points its shards when its root is allocated, so a pipeline rank running
    several stages allocates each stage's root (strategies/pipeline/cut.py's views).
    Without `init_fn`, a transformers model initialises its modules as `from_config` would.
    `fills`: what `init_replay.recorded_fills` noted while the model was built under init_module:
    each tensor then gets the numbers one process drew for it, and the generator is left where the
    construction left it (as in one process, whose initialisation is over by then)."""
    if init_fn is None:
        present = {id(m) for m in model.modules()}
        init_fn = transformers_init(model, cut_away=[m for m in order or () if id(m) not in present])
    check_initialisable(model, init_fn)
    meta_modules = [m for m in model.modules() if _owns_state(m) and any(t.is_meta for t in _own_tensors(m))]
    if order is not None:
        mine = {id(m) for m in meta_modules}
        present = {id(m) for m in model.modules()}
        last = max((i for i, m in enumerate(order) if id(m) in mine), default=-1)
        # up to this stage's last module: the draws after it change nothing here
        meta_modules = [
            m
            for m in order[: last + 1]
            if id(m) in mine or (id(m) not in present and _owns_state(m) and any(t.is_meta for t in _own_tensors(m)))
        ]
        check_initialisable(nn.ModuleList(m for m in meta_modules if id(m) not in present), init_fn)
    sync_rng_from_rank0(device)
    fills = init_replay.same_on_every_rank(fills or {})
    constructed = torch.get_rng_state()
    for root in roots if roots is not None else (model,):
        _allocate(root, device, param_device)
    for module in meta_modules:
        _init_one(module, init_fn, device, fills)
    if fills:
        torch.set_rng_state(constructed)


def _allocate(model: nn.Module, device: torch.device, param_device: torch.device | None) -> None:
    # to_empty re-allocates every tensor (FSDP2 re-points its shard storage on it): keep the values
    # of tensors that were real already (a partly meta model) and put them back.
    kept = {name: _local(t).detach().clone() for name, t in _named_tensors(model) if not t.is_meta}
    model.to_empty(device=param_device or device)
    if param_device is not None and param_device != device:
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    with torch.no_grad():
        for name, t in _named_tensors(model):
            if name in kept:
                _local(t).copy_(kept[name])
