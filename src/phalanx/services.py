"""What runs beside a training loop, wired once when `Phalanx()` starts: the watchdog, the
checkpointer with its deferred saves, preemption, logging, the observer and the profiler. The
facade (facade.py) holds them; each lives in its own room."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from phalanx.checkpoint.deferred import DeferredSave
from phalanx.checkpoint.manager import Checkpointer
from phalanx.config import PhalanxConfig
from phalanx.logging import session as log_session
from phalanx.observe import start as observe
from phalanx.preemption import worker as preemption
from phalanx.runtime import collectives, watchdog
from phalanx.runtime.context import AgentEnv, DistContext
from phalanx.runtime.process_group import destroy_process_group
from phalanx.runtime.profiler import StepProfiler
from phalanx.runtime.step_tracker import StepTracker
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import schedules as pipeline_schedules


@dataclass
class Services:
    watchdog: Any
    checkpointer: Checkpointer
    preemption: Any
    deferred_save: DeferredSave
    logging: Any
    observe: Any
    profiler: StepProfiler | None


def start(
    ctx: DistContext,
    cfg: PhalanxConfig,
    plan: ParallelPlan,
    progress: StepTracker,
    *,
    strategy_name: str,
    seed: int,
    cycle_idle: Callable[[], bool],
    save_now: Callable[[Any, Any], str],
) -> Services:
    """Start every service of one `Phalanx()` on this rank (the plan's pipeline stages name the
    ranks in the watchdog's reports; `cycle_idle`: no gradient-accumulation cycle is half done)."""
    dog = watchdog.start_watchdog(
        ctx.rank,
        ctx.world_size,
        progress,
        cfg.watchdog_timeout,
        destroy_process_group,
        collective_timeout=cfg.collective_timeout,
        labels=pipeline_schedules.rank_labels(plan, cfg.pp_schedule),
    )
    checkpointer = Checkpointer(
        strategy_name=strategy_name,
        seed=seed,
        keep=cfg.checkpoint_keep,
        async_save=cfg.checkpoint_async,
        directory=cfg.checkpoint_dir,
    )
    preempt = preemption.start(  # signals -> a checkpoint of an agreed step, then exit 128+N
        signals=cfg.preemption_signals,
        checkpointer=checkpointer,
        rank=ctx.rank,
        world_size=ctx.world_size,
        progress=progress,
        grace=cfg.preempt_grace,
        cycle_idle=cycle_idle,
        busy=progress.busy_with,
        watchdog=dog,
    )
    deferred = DeferredSave(checkpointer, cycle_idle, save_now)  # save_state() mid-cycle: at the cycle's end
    progress.batch_request_hooks.append(deferred.at_boundary)
    logs = log_session.start(
        ctx.rank,
        ctx.is_main_process,
        collectives.broadcast_object,
        log_session.LoggingSettings.from_config(cfg),
        ctx.dp_size,
    )
    watcher = (
        None
        if not cfg.step_anatomy
        else observe.start(  # phase times, stragglers, status
            progress,
            dog,
            rank=ctx.rank,
            world_size=ctx.world_size,
            local_rank=ctx.local_rank,
            attempt=AgentEnv.from_env().attempt,
            run_dir=logs.run_dir,
            device=ctx.device,
            metrics=logs.metrics,
            job_step=lambda: checkpointer.global_step if checkpointer.counts_steps else None,
        )
    )
    profiler = (
        None
        if cfg.profile is None
        else StepProfiler(cfg.profile, ctx.rank, logs.run_dir, lambda: checkpointer.global_step)
    )
    return Services(dog, checkpointer, preempt, deferred, logs, watcher, profiler)
