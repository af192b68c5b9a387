"""Regional `torch.compile`: each sharding unit's forward is compiled on its own (as torchtitan
does), so graph breaks at unit boundaries are by design and FSDP's hooks stay outside the graphs.

Compiling `module.forward` in place keeps parameter names (no `_orig_mod.` in state dicts). On CPU
inductor needs a C++ compiler: without one phalanx says so once and runs eager instead of failing
at the first step.
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
    return units
