"""The per-unit transforms every strategy applies before wrapping or sharding the model, in
torchtitan's order: activation checkpointing inside, then compile, then (zero2/zero3) fully_shard."""
from __future__ import annotations

import torch
from torch import nn

from phalanx.strategies import activation_ckpt, compile as compile_units
from phalanx.strategies.base import StrategyOptions


def transform_units(model: nn.Module, units: list[nn.Module], options: StrategyOptions,
                    device: torch.device) -> list[nn.Module]:
    """Checkpoint, then compile, the units; returns the units to shard (wrappers where wrapped).
    A model without units compiles its root forward."""
    units = activation_ckpt.apply(model, options.activation_checkpointing, units)
    compile_units.apply(units or [model], options.compile, device)
    return units
