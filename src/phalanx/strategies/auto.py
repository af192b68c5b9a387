"""`auto`: ddp when the model state fits the per-device budget, else zero3. A decision, not a
strategy: the facade asks once the model is known (at prepare) and builds the plan it names."""

from __future__ import annotations

from torch import nn

from phalanx.model import memory
from phalanx.model.units import default_units
from phalanx.runtime.context import DistContext
from phalanx.strategies import memory_plan
from phalanx.strategies.plan import presets
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.plan.parallel_plan import ParallelPlan


def budget_bytes(ctx: DistContext, options: StrategyOptions) -> int:
    """The per-device bytes the model state may take under ddp (memory_budget, else from the device)."""
    if options.memory_budget_bytes is not None:
        return int(options.memory_budget_bytes)
    return memory.device_budget_bytes(ctx.device, ctx.local_world_size)


def decide(model: nn.Module, ctx: DistContext, options: StrategyOptions, plan: ParallelPlan) -> tuple[str, str]:
    """(preset name, why) for this model over the data-parallel ranks `plan` (the job's degrees)
    leaves after tensor and pipeline parallel; under pp the largest pipeline rank's stages are what
    must fit.

    auto stays data-parallel: when even zero3 across the ranks does not fit, it still picks zero3
    and says which tp would fit instead, rather than choosing tensor parallel silently."""
    sizes = memory.model_sizes(model)
    if plan.pp > 1:
        from phalanx.strategies.pipeline import layout as pipeline_layout

        mine = pipeline_layout.largest_rank_units(model, plan, options)
        sizes = [s for s in sizes if any(s.name == u or s.name.startswith(f"{u}.") for u in mine)]
    if plan.pp > 1 and plan.grad_size == 1:
        return presets.AUTO_CHOOSES[0], (
            f"pp={plan.pp}{f' x tp={plan.tp}' if plan.tp > 1 else ''} takes every "
            "process: no data-parallel ranks to replicate or shard over"
        )
    budget = budget_bytes(ctx, options)
    name, reason = memory_plan.recommend(sizes, plan, budget)
    if plan.pp > 1:
        reason += f" (the largest of the pp={plan.pp} pipeline ranks' stages)"
    if name == presets.AUTO_CHOOSES[-1]:  # sharded, and still over the budget: say what would fit
        largest = max((memory.unit_bytes(unit) for unit in default_units(model)), default=0)
        hint = memory_plan.tp_that_fits(sizes, plan, ctx.local_world_size, budget, largest)
        if hint:
            reason += f"; {hint}"
    return name, reason
