"""`auto`: ddp when the model state fits the per-device budget, else zero3 (decided at prepare,
when the model is known). Delegates everything to the strategy it picked."""
from __future__ import annotations

from typing import Any

from torch import nn

from phalanx.logging.rank_log import get_logger
from phalanx.runtime.context import DistContext
from phalanx.strategies.base import Strategy, StrategyOptions
from phalanx.strategies import ddp_rules, memory


class AutoStrategy:
    def __init__(self, ctx: DistContext, options: StrategyOptions | None = None):
        self.ctx = ctx
        self.options = options or StrategyOptions()
        self.chosen: Strategy | None = None
        self.reason = ""

    @property
    def name(self) -> str:
        return self.chosen.name if self.chosen is not None else "auto"

    @property
    def precision(self) -> Any:
        return self._strategy().precision

    def budget_bytes(self) -> int:
        if self.options.memory_budget_bytes is not None:
            return int(self.options.memory_budget_bytes)
        return memory.device_budget_bytes(self.ctx.device, self.ctx.local_world_size)

    def _strategy(self) -> Strategy:
        if self.chosen is None:
            raise RuntimeError("strategy 'auto' decides when the model is prepared. "
                               "HINT: call px.prepare(model, ...) first.")
        return self.chosen

    def setup_model(self, model: nn.Module) -> nn.Module:
        if self.chosen is None:
            from phalanx.strategies import registry

            sizes = memory.model_sizes(model)
            name, self.reason = memory.recommend(sizes, self.ctx.world_size, self.budget_bytes(),
                                                 self.options.mixed_precision)
            ddp_rules.refuse_without_ddp(name, self.options.ddp.asked(), f" (strategy auto chose {name}: {self.reason})")
            self.chosen = registry.create(name, self.ctx, self.options)
            # The start-up line could only say "auto": say what it chose, once the model is known.
            get_logger().info("strategy auto chose %s: %s", name, self.reason)
        return self.chosen.setup_model(model)

    def __getattr__(self, attr: str) -> Any:
        # setup_optimizer, backward, no_sync, unwrap, clip_grad_norm_, full_state_dict
        if attr.startswith("_") or attr in ("chosen", "ctx", "options", "reason"):
            raise AttributeError(attr)
        return getattr(self._strategy(), attr)
