"""The narrow interface the facade talks to; strategies/strategy.py implements it for every plan."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch
from torch import nn

from phalanx.loop.precision import Precision
from phalanx.strategies.context.step import ContextParallel
from phalanx.strategies.layout import Layout
from phalanx.strategies.plan.parallel_plan import ParallelPlan


class Strategy(Protocol):
    """How a model and optimizer are spread over ranks and kept in step."""

    name: str
    precision: Precision
    plan: ParallelPlan
    """The layout it applies: every layout question is the plan's."""
    mesh: Any
    """The DeviceMesh with the plan's named dims; None in a world of one."""
    dp_group: Any
    """The process group of the ranks that read different data (None: every rank)."""
    layout: Layout
    """The mesh and every named group of the plan (strategies/layout.py)."""
    context: ContextParallel
    """cp: this rank's cut of each row and the verbs over it (size 1: no cut, calls pass through)."""

    def setup_model(self, model: nn.Module, compiled: dict[str, Any] | None = None) -> nn.Module:
        """Move `model` to the device and wrap it for this strategy; `compiled`: the script compiled
        it before prepare with these torch.compile options, so its units are compiled with them
        (unless the compile setting gives its own)."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        """Make `optimizer` act on the parameters of the wrapped `model` (same groups/hyperparameters)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaling it when the strategy needs to)."""

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip gradient synchronisation inside the block (accumulation micro-steps)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever wrapper the strategy added."""

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the global norm over all ranks; return that norm (a plain tensor)."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded weights (on CPU for sharded strategies) on the main process."""

    def dropped_tokens(self) -> dict[str, int]:
        """ep with a capacity factor: each MoE layer's token-choices dropped in the last optimizer step."""

    def before_step(self) -> None:
        """Once per optimizer step, before clipping (pp: gradients of weights tied across stages summed)."""

    def pipeline(self, model: nn.Module) -> Any:
        """The pipeline runner of a prepared model (pp > 1); None in other layouts."""

    def stage_filter(self) -> Callable[[str], bool] | None:
        """For loading full weights: which state-dict keys belong to other ranks' pipeline stages
        (None: every key is this rank's)."""

    def unsynced_batchnorm_warning(self, model: nn.Module) -> str | None:
        """What prepare says where BatchNorm layers keep per-rank statistics in a data-parallel layout."""

    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """BatchNorm layers synced over the ranks that read different data (refused where they can't be)."""
