"""Settings against the layout they will run in: a setting whose need (its schema row's `needs`)
the parallel plan lacks is refused by name, never silently ignored. Pure Python, no torch:
`phalanx run` runs it before any worker starts, `Phalanx()` before it joins the process group, and
strategy auto once it has decided.

In a world of one every preset runs as one plain process, so the check uses the layout the
settings describe at scale: `strategy: zero3` with a DDP comm hook is refused even under plain
python (the settings contradict each other), `strategy: ddp` with one is not (the same script then
runs at every scale).
"""

from __future__ import annotations

from typing import Any

from phalanx.config import ConfigError, Resolved, Setting, RUNTIME
from phalanx.config.names import Needs
from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import schedules

_ADVISORY = {Needs.AUTO}  # read by one preset only, harmless elsewhere: a warning, not an error


def asks(setting: Setting, value: Any) -> bool:
    """Whether a value asks for something: anything but the row's default (comm_hook none, ...)."""
    return value is not None and value != setting.default


def unmet(resolved: Resolved, plan: ParallelPlan | None) -> list[Setting]:
    """Settings somebody set whose need the layout lacks; `plan` None: strategy auto, undecided
    (what it may choose is checked once it has; until then the degrees the settings ask for)."""
    cfg = resolved.config
    missing = []
    for setting in RUNTIME:
        if setting.needs is Needs.ALWAYS or not resolved.is_set(setting.name):
            continue
        if not asks(setting, getattr(cfg, setting.name)):
            continue
        if plan is None:
            met = (
                setting.needs in (Needs.AUTO, Needs.DDP, Needs.FSDP, Needs.ROW_SHARDED_EMBEDDINGS)
                or (setting.needs is Needs.TENSOR_PARALLEL and cfg.tp > 1)
                or (setting.needs is Needs.PIPELINE and cfg.pp > 1)
            )
        else:
            met = plan.has(setting.needs)
        if not met:
            missing.append(setting)
    return missing


def checked_plan(resolved: Resolved, plan: ParallelPlan, *, decided: bool = False) -> ParallelPlan | None:
    """The plan the settings are checked against: the job's own (`plan`), None while strategy auto
    has not decided, and in a world of one the layout the settings describe at the smallest scale it
    could run in (one script, every scale: `strategy: zero3` with a DDP comm hook is refused even
    under plain python)."""
    name = presets.canonical(resolved.config.strategy)
    if name == presets.AUTO and not decided:
        return None
    if plan.is_distributed or plan.threads_over_gpus:
        return plan
    try:
        return presets.at_scale(name, resolved.config)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check(resolved: Resolved, plan: ParallelPlan | None, *, chose: str = "") -> list[str]:
    """ConfigError for the first need the layout lacks (every setting asking for it named, with
    where it came from); warnings for advisory ones. `chose`: why auto picked the plan."""
    check_pipeline(resolved, plan)
    warnings = []
    by_need: dict[Needs, list[Setting]] = {}
    for setting in unmet(resolved, plan):
        by_need.setdefault(setting.needs, []).append(setting)
    for need, settings in by_need.items():
        asked = ", ".join(f"{s.name}={getattr(resolved.config, s.name)!r}" for s in settings)
        sources = sorted(
            {resolved.origin[s.name] for s in settings}
            | ({resolved.origin["strategy"]} if "strategy" in resolved.origin else set())
        )
        where = f" (strategy auto chose {chose})" if chose else (f" (from {', '.join(sources)})" if sources else "")
        if need in _ADVISORY:
            warnings.append(f"{asked}{where}: read by {need.value} only; {_layout(resolved, plan)} ignores it")
            continue
        raise ConfigError(f"{asked}{where}: {_refusal(need, resolved, plan)}")
    return warnings


def check_pipeline(resolved: Resolved, plan: ParallelPlan | None) -> None:
    """ConfigError for pipeline settings the settings alone show wrong: too few microbatches for the
    schedule, a pp_split that makes another number of stages, DDP's find_unused_parameters turned off."""
    cfg = resolved.config
    if cfg.pp == 1:
        return
    per_rank = schedules.stages_per_rank(cfg.pp_schedule)
    try:
        if cfg.pp_microbatches is not None:
            schedules.check_microbatches(cfg.pp_schedule, cfg.pp, cfg.pp_microbatches)
    except ValueError as error:
        raise ConfigError(f"{error} (pp_schedule={cfg.pp_schedule})") from None
    if cfg.pp_split is not None and len(cfg.pp_split) != cfg.pp * per_rank - 1:
        each = f", {per_rank} per pipeline rank under pp_schedule={cfg.pp_schedule}" if per_rank > 1 else ""
        raise ConfigError(
            f"pp_split={cfg.pp_split} names {len(cfg.pp_split)} cut point(s), which makes {len(cfg.pp_split) + 1} "
            f"stage(s), but pp={cfg.pp} runs {cfg.pp * per_rank} stage(s){each}. HINT: name "
            f"{cfg.pp * per_rank - 1} module(s) to cut before, or drop pp_split to cut evenly by parameter count"
        )
    if resolved.is_set("find_unused_parameters") and not cfg.find_unused_parameters and (plan is None or plan.uses_ddp):
        raise ConfigError(
            f"find_unused_parameters=False with pp={cfg.pp}: DistributedDataParallel over a pipeline stage must "
            "look for unused parameters (torch's stage runs its first, shape-finding microbatch outside no_sync, "
            "and without it the next new input shape fails in DDP's reducer), so phalanx turns it on under pp. "
            "HINT: drop the setting"
        )
    if cfg.static_graph and (plan is None or plan.uses_ddp):
        raise ConfigError(
            f"static_graph=True with pp={cfg.pp}: a pipeline stage's DDP does not run a static graph (torch's stage "
            "runs a shape-finding microbatch, then the others under no_sync), and with it the gradients came out "
            "wrong, silently (measured: pp2 x ddp2 left one process's losses by 2e-3 in 3 steps). HINT: drop the "
            "setting"
        )


def _layout(resolved: Resolved, plan: ParallelPlan | None) -> str:
    name = plan.preset if plan is not None else presets.AUTO
    tp = plan.tp if plan is not None else resolved.config.tp
    return (
        f"strategy {name!r}"
        + (f" with tp={tp}" if tp > 1 else "")
        + (f" with pp={plan.pp}" if plan is not None and plan.pp > 1 else "")
    )


def _refusal(need: Needs, resolved: Resolved, plan: ParallelPlan | None) -> str:
    layout = _layout(resolved, plan)
    tp = plan.tp if plan is not None else resolved.config.tp
    if need is Needs.DDP:
        engine = "DataParallel" if plan is not None and plan.threads_over_gpus else "FSDP2"
        why = " (tensor parallel composes with FSDP2)" if tp > 1 else ""
        return (
            f"DistributedDataParallel options, but {layout} uses {engine}{why}, which has no DDP. HINT: use "
            f"strategy ddp or zero1{' with tp=1' if tp > 1 else ''} for them, or drop them (zero2/zero3 need "
            "no find_unused_parameters: FSDP2 handles unused parameters)"
        )
    if need is Needs.ROW_SHARDED_EMBEDDINGS:
        return (
            f"only zero2/zero3 on one data-parallel dimension, without CPU offload or tensor parallel, look "
            f"embeddings up where their rows live, and {layout} is not that layout. HINT: drop the setting"
        )
    if need is Needs.SHARDED_OPTIMIZER:
        return (
            f"only zero1 over more than one data-parallel rank gathers sharded optimizer updates, and {layout} "
            "is not that layout (auto picks ddp or zero3). HINT: use strategy zero1, or drop the setting"
        )
    if need is Needs.TENSOR_PARALLEL:
        return "a tensor-parallel setting, but tp is 1. HINT: set tp > 1 (e.g. --tp 2), or drop it"
    if need is Needs.PIPELINE:
        return "a pipeline setting, but pp is 1. HINT: set pp > 1 (e.g. --pp 2), or drop it"
    return f"needs {need.value}, which {layout} does not use. HINT: drop the setting"
