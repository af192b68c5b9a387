"""The dimensions the strategy applies to each prepared model beside parallelize's fixed steps, each
through the same hooks, so that the strategy (strategy.py) asks hooks and names none of them. A
dimension of this kind (expert parallel, `ep`: strategies/expert_parallel/) is one entry of `per_model`.

A dimension's `apply(model)` returns what it applied to that model (an `Applied`), or None where
its degree is 1; the strategy then routes torch's clip_grad_norm_ through its `norm` (outside pp,
whose norm counts every stage's), hands it each optimizer, and lets it complete full weights."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from phalanx.strategies.expert_parallel import plan_report
from phalanx.strategies.expert_parallel.dimension import ExpertDimension
from phalanx.strategies.expert_parallel.options import ExpertOptions
from phalanx.strategies.layout import Layout


@dataclass
class DimensionOptions(ExpertOptions):
    """Every per-model dimension's options (`strategy_options` keys), gathered: `StrategyOptions` has them."""


class Applied(Protocol):
    """A dimension as applied to one prepared model."""

    def norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The gradients' norm, with the parameters this dimension split counted once."""
        ...

    def count_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer over the model's parameters (its steps end what the dimension counts per step)."""
        ...

    def full(self, state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """`state` with this dimension's split weights gathered whole."""
        ...

    def dropped_tokens(self) -> dict[str, int]:
        """What the last optimizer step dropped, per layer ({}: nothing to report)."""
        ...


class ModelDimension(Protocol):
    after_tp: bool  # applied between tensor parallel and data parallel (else before anything)

    def apply(self, model: nn.Module) -> Applied | None: ...


def per_model(layout: Layout, device: torch.device, options: Any) -> list[ModelDimension]:
    """The dimensions applied to each model prepared in `layout`."""
    return [ExpertDimension(layout, device, options)]


def plan_lines(
    args: argparse.Namespace, model: Any, sizes: list[Any], optimizer: str, fb: Callable[[float], str]
) -> str:
    """`phalanx plan`'s lines under its table for the per-model dimensions its flags ask for ('' for
    none); ValueError as prepare would refuse."""
    return "\n".join(text for text in [plan_report.report(args, model, sizes, optimizer, fb)] if text)
