"""`auto`: ddp when the model state fits the per-device budget, else zero3. A decision, not a
strategy: the facade asks once the model is known (at prepare) and creates the strategy it names."""
from __future__ import annotations

from torch import nn

from phalanx.runtime.context import DistContext
from phalanx.strategies import ddp_rules
from phalanx.model import memory
from phalanx.strategies.base import StrategyOptions


def budget_bytes(ctx: DistContext, options: StrategyOptions) -> int:
    """The per-device bytes the model state may take under ddp (memory_budget, else from the device)."""
    if options.memory_budget_bytes is not None:
        return int(options.memory_budget_bytes)
    return memory.device_budget_bytes(ctx.device, ctx.local_world_size)


def decide(model: nn.Module, ctx: DistContext, options: StrategyOptions) -> tuple[str, str]:
    """(strategy name, why) for this model; DDP options given for a model auto shards are refused."""
    name, reason = memory.recommend(memory.model_sizes(model), ctx.world_size, budget_bytes(ctx, options),
                                    options.mixed_precision)
    ddp_rules.refuse_without_ddp(name, options.ddp.asked(), f" (strategy auto chose {name}: {reason})")
    return name, reason
