"""Regional `torch.compile`: each sharding unit's forward is compiled on its own (as torchtitan
does), so graph breaks at unit boundaries are by design and FSDP's hooks stay outside the graphs.

Compiling `module.forward` in place keeps parameter names (no `_orig_mod.` in state dicts). On CPU
inductor needs a C++ compiler: without one phalanx says so once and runs eager instead of failing
at the first step.

Under tensor parallel a unit's input can be an `AsyncCollectiveTensor`: the embedding's
`RowwiseParallel` all-reduces its output with `async_op=True` and hands back the local tensor before
the collective is waited. torch 2.13's compile unwraps such an input with `trigger_wait()`, which
drops its `requires_grad` (pytorch/pytorch#179849's unwrap; #191113 restores it): the graph is
traced without that input's gradient, which arrives at the eager redistribution as a plain tensor
("'Tensor' object has no attribute '_local_tensor'" in DTensor's Redistribute backward) or not at
all (zero). Each compiled unit therefore waits such inputs itself, keeping their autograd edge,
before its compiled forward sees them.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Mapping, Union

import torch
from torch import nn

from phalanx.logging.rank_log import get_logger

CompileSpec = Union[bool, Mapping[str, Any], None]


def find_cxx_compiler() -> str | None:
    """Path of the C++ compiler inductor would use on CPU ($CXX, else g++/c++/clang++), or None."""
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def options_of(spec: CompileSpec) -> dict[str, Any] | None:
    """torch.compile keyword arguments, or None when compile is off."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return {}
    if isinstance(spec, Mapping):
        return dict(spec)
    raise ValueError(f"compile must be True/False or a dict of torch.compile options, got {spec!r}")


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, dict[str, Any] | None]:
    """A model the script compiled before prepare (`model = torch.compile(model)`, an OptimizedModule)
    as the module inside it, and the torch.compile options to compile it again with (None: it was
    not compiled). The layout applies to the module (its names carry no `_orig_mod.`, its class has
    the tensor-parallel and pipeline plans), then phalanx compiles each sharding unit with the
    script's own backend (its mode and options inside it), as one process compiles the whole."""
    if not isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model, None
    get_logger().info(
        "px.prepare: the model came compiled (torch.compile(model)); phalanx lays out the module inside it "
        "and compiles each sharding unit with the same backend (Phalanx(compile={...}) sets other options)"
    )
    return model._orig_mod, _backend_of(model)


def _backend_of(compiled: nn.Module) -> dict[str, Any]:
    """{"backend": the compiler torch.compile was given (its mode and options inside)}, read where
    torch keeps it (tests/unit/test_compile_unwrap.py pins it); {} (torch's default) if not found."""
    try:
        from torch._dynamo.eval_frame import innermost_backend

        backend = innermost_backend(compiled.dynamo_ctx.callback)  # type: ignore[union-attr]
    except (ImportError, AttributeError):
        return {}
    return {"backend": backend} if callable(backend) else {}


def usable(device: torch.device) -> bool:
    """False (with one warning) when compiling cannot work here: CPU without a C++ compiler."""
    if device.type == "cpu" and find_cxx_compiler() is None:
        get_logger().warning(
            "compile=True needs a C/C++ compiler for torch.compile on CPU and none was found "
            "(set CXX or install g++); running eager instead"
        )
        return False
    return True


def apply(units: list[nn.Module], spec: CompileSpec, device: torch.device) -> list[nn.Module]:
    """Compile each unit's forward in place; return the units compiled (none when compile is off)."""
    options = options_of(spec)
    if options is None or not usable(device):
        return []
    for unit in units:
        unit.forward = torch.compile(unit.forward, **options)
        unit.register_forward_pre_hook(_wait_async_inputs, with_kwargs=True)
    return units


class _Waited(torch.autograd.Function):
    """An `AsyncCollectiveTensor`'s waited value as a plain tensor, with the gradient passed through
    to it (its own `trigger_wait()` returns the inner tensor, which is outside the autograd graph)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        waited = tensor.trigger_wait()  # type: ignore[attr-defined]
        return waited.view_as(waited)  # a fresh tensor object: autograd's metadata is set on it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _wait_async_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a compiled unit: its `AsyncCollectiveTensor` inputs waited (see above)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_any, tree_map_only

    if not tree_any(lambda x: isinstance(x, AsyncCollectiveTensor), (args, kwargs)):
        return None
    return tree_map_only(AsyncCollectiveTensor, _Waited.apply, (args, kwargs))
