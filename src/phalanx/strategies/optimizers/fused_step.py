"""Which kernel steps the script's optimizer, where the script left the choice to torch: the one
place that chooses, for every data-parallel layout.

On CPU torch steps Adam and AdamW parameter by parameter (`foreach` is a CUDA default; the
multi-tensor step is no faster on CPU), about eight passes over each tensor. Its fused kernel
does the same arithmetic in one vectorised pass: on bench/guard.py's encoder (4.2M fp32
parameters, 1 thread) AdamW's step took 6.5 ms of CPU against 22 ms, about 7% of a ddp step, and
the weights after 6 steps were within 1.2e-7 of the per-parameter loop's (the same update, fp32
rounding apart). The fused kernel takes FSDP2's Shard(0) DTensors as they are, uneven and empty
local shards included (2 gloo ranks, 4 steps: the same weights as the foreach step, within 1e-9),
so zero2, zero3 and hsdp use it too. An explicit `fused` or `foreach` (True or False) is the
script's choice and kept. On a GPU nothing changes: the fused CPU kernel is not asked for, and
sharded parameters take the multi-tensor step, torch's CUDA default.
"""

from __future__ import annotations

import torch

_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW)  # exact types: a subclass may step otherwise


def _is_dtensor(p: torch.Tensor) -> bool:
    return hasattr(p, "device_mesh")


def _fits(params: list[torch.Tensor], sharded: bool) -> bool:
    """Floating-point CPU tensors, all plain or (`sharded`) all DTensors: what torch's fused CPU
    kernel takes (a complex or a GPU parameter, or a group mixing DTensors with plain tensors, keeps
    torch's own choice)."""
    return bool(params) and all(
        p.device.type == "cpu" and p.is_floating_point() and _is_dtensor(p) == sharded for p in params
    )


def prefer_fused(optimizer: torch.optim.Optimizer, *, sharded: bool = False) -> None:
    """Step `optimizer`'s groups with torch's fused CPU kernel where the script set neither `fused`
    nor `foreach` (nor `differentiable`, which fused refuses). `sharded`: the groups hold FSDP2's
    DTensor parameters (zero2, zero3, hsdp)."""
    if type(optimizer) not in _FUSED_ON_CPU:
        return
    for group in optimizer.param_groups:
        unset = group.get("fused") is None and group.get("foreach") is None
        if unset and not group.get("differentiable") and _fits(group["params"], sharded):
            group["fused"] = True


def prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Use the multi-tensor (foreach) step where the user left the kernel unset. torch picks the
    per-parameter loop on CPU, and over FSDP2's DTensor parameters every one of its ~8 ops per
    parameter pays DTensor's dispatch: measured on bench/strategies.py's encoder (51 parameters),
    AdamW's step went from 21 to 13 ms CPU. An explicit foreach=False is kept.

    A group that mixes DTensors with plain tensors (tensor parallel alone leaves the layers outside
    its plan whole) cannot take a multi-tensor step at all: it steps per parameter."""
    if "foreach" not in optimizer.defaults:
        return
    for group in optimizer.param_groups:
        kinds = {_is_dtensor(p) for p in group["params"]}
        if len(kinds) > 1:
            group["foreach"] = False
        elif group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True


def choose(optimizer: torch.optim.Optimizer, *, sharded: bool) -> None:
    """The step kernel for a data-parallel layout: fused on CPU where it fits; for sharded (DTensor)
    parameters otherwise the multi-tensor step."""
    prefer_fused(optimizer, sharded=sharded)
    if sharded:
        prefer_foreach(optimizer)
