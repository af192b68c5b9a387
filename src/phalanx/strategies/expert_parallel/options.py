"""ep's options (`strategy_options` keys), declared with ep: `StrategyOptions` gathers them through
strategies/dimensions.py's `DimensionOptions`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertOptions:
    ep_plan: dict[str, str] | None = None
    """ep > 1: {module or parameter name pattern: ep_dispatch_experts | grouped_gemm}; None: the model's
    own transformers `base_model_ep_plan`. It may hold `capacity_factor` too (below)."""
    capacity_factor: float | None = None
    """ep > 1: each expert takes at most ceil(capacity_factor x tokens x top_k / experts) token-choices
    of its ep group per layer and forward, the rest dropped and counted (px.moe_dropped_tokens); None:
    none dropped (docs/moe.md)."""
