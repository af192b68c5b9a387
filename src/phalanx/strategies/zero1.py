"""ZeRO-1: DDP for gradients + an optimizer whose state is split evenly over ranks: each rank steps
its dim-0 chunk of every parameter and the chunks are all-gathered after each step
(strategies/sharded_optimizer.py). torch's ZeroRedundancyOptimizer, which gives each whole
parameter to one rank, is still accepted when the user passes one."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch import nn

from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.sharded_optimizer import ShardedStateOptimizer


class Zero1Strategy(DDPStrategy):
    name = "zero1"

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        if isinstance(optimizer, (ZeroRedundancyOptimizer, ShardedStateOptimizer)):
            return optimizer
        refuse_optimizer_with_state(optimizer, self.name)
        # DDP keeps the user's Parameter objects, so the groups carry over as they are.
        groups = [dict(group) for group in optimizer.param_groups]
        return ShardedStateOptimizer(groups, optimizer_class=type(optimizer), **constructor_defaults(optimizer))


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.defaults` restricted to what its class's constructor accepts.

    (e.g. AdamW records `decoupled_weight_decay` in defaults but does not take it as an argument.)
    """
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def refuse_optimizer_with_state(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    if len(optimizer.state) > 0:
        raise ValueError(
            f"strategy {strategy!r} re-binds the optimizer's state to sharded parameters, but this "
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s). "
            "HINT: call px.prepare(model, optimizer) before the first optimizer.step() or "
            "load_state_dict(), and load optimizer state into the prepared optimizer."
        )
