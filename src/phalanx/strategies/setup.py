"""The job's strategy, set up for the facade: the plan `Phalanx()` runs (the launcher's, or built
here once), the strategy adopted from it (the layout object and every group, built by every rank
together), and strategy auto's decision at prepare. The facade calls these and keeps no plan
arithmetic, no group and no strategy internals of its own."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from phalanx.config import PhalanxConfig
from phalanx.host_only import host_memory
from phalanx.logging.rank_log import get_logger
from phalanx.runtime.context import DistContext
from phalanx.strategies import auto
from phalanx.strategies.choice import StrategyChoice
from phalanx.strategies.layout import Layout
from phalanx.strategies.plan import job_plan, presets, settings_check
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.strategy import ParallelStrategy

AUTO = presets.AUTO  # the name of the strategy that decides at prepare(model)


def job_plan_for(choice: StrategyChoice, resolved: Any, ctx: DistContext, handed: str) -> ParallelPlan:
    """The job's one plan: the launcher's (`handed`) when these settings ask for it, else built here,
    once; strategy auto's is the plan of its degrees until it decides (at prepare, from the model).
    The settings are checked against it (warnings logged, errors raised)."""
    options = choice.options
    plan = job_plan.plan_for(
        choice.strategy,
        resolved.config,
        handed,
        world_size=ctx.world_size,
        local_world_size=ctx.local_world_size,
        cpu_offload=options.cpu_offload,
        replicate_size=options.replicate_size,  # hsdp's shape options, from strategy_options
        shard_size=options.shard_size,
    )
    for warning in settings_check.check(resolved, settings_check.checked_plan(resolved, plan)):
        get_logger().warning("%s", warning)
    return plan


def undecided(choice: StrategyChoice, plan: ParallelPlan) -> bool:
    """Strategy auto, still to decide from the model (a world of one has nothing to decide)."""
    return presets.canonical(choice.strategy) == AUTO and plan.is_distributed


def adopt(
    plan: ParallelPlan, ctx: DistContext, cfg: PhalanxConfig, choice: StrategyChoice, before_clip: Callable[[], None]
) -> ParallelStrategy:
    """The strategy of `plan`: its mesh and every group (every rank, together). `before_clip`: what
    torch's clip_grad_norm_ on a prepared model runs first, as px.clip_grad_norm_ does."""
    # tensors in host memory (gloo): zero2/zero3's freed blocks go back to the system
    host_memory.fix_for(ctx.backend, cfg.host_mmap_threshold, plan.frees_gathered_blocks)
    layout = Layout.build(plan, ctx.device.type)  # the mesh and every group, asked by name
    strategy = ParallelStrategy(layout, ctx, choice.options)
    strategy.before_clip = before_clip
    return strategy


def decide(
    model: nn.Module,
    ctx: DistContext,
    cfg: PhalanxConfig,
    choice: StrategyChoice,
    plan: ParallelPlan,
    resolved: Any,
    before_clip: Callable[[], None],
) -> ParallelStrategy:
    """Strategy auto's strategy for `model`: replicas or shards of `plan`'s degrees, sized from the
    model, the settings checked against that plan, then adopted (as `adopt`)."""
    name, reason = auto.decide(model, ctx, choice.options, plan)
    decided = presets.decided(plan, name, cpu_offload=choice.options.cpu_offload)
    settings_check.check(
        resolved, settings_check.checked_plan(resolved, decided, decided=True), chose=f"{name}: {reason}"
    )
    strategy = adopt(decided, ctx, cfg, choice, before_clip)
    get_logger().info("strategy auto chose %s: %s", name, reason)
    return strategy
