"""Strategy names as presets of the parallel plan: `ddp` is "replicate N", `zero3` is "shard N,
parameters too", `hsdp` is "replicate across nodes x shard within a node". Each preset composes with
tensor parallel (`tp`) and pipeline parallel (`pp`): the data-parallel dims get the processes left
after them, and under pp each stage's parameters are what the preset replicates or shards.

Aliases are resolved where the setting is parsed (config/names.py); this is the one table that
turns a canonical name into a plan. Pure Python, no torch.
"""

from __future__ import annotations

import math
import types
from typing import Any, Mapping

from phalanx import config
from phalanx.config import names
from phalanx.strategies.plan.parallel_plan import MESH_DIMS, ParallelPlan, Sharding

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")  # what a preset gives the processes the other dims leave

# The names come from config/names.py's one table; this module turns each into a plan.
AUTO, SINGLE, AUTO_CHOOSES, PRESETS = names.AUTO, names.SINGLE, names.AUTO_CHOOSES, names.PRESETS


def sharding(name: str) -> Sharding:
    """What preset `name`'s data-parallel shard dim splits (its ZeRO stage)."""
    return Sharding(PRESETS[name].stage)


def multi_process() -> list[str]:
    """The presets that run several processes, least communication first (the table's order)."""
    return [name for name, preset in PRESETS.items() if name != SINGLE and not preset.threads_over_gpus]


def asking(**settings: Any) -> config.PhalanxConfig:
    """The settings that ask for a layout (`asking(tp=2, pp=2)`), checked by their schema rows: what
    `build` takes when no job's settings exist (the docs' tables, tests)."""
    return config.resolve(config.from_kwargs(settings), warn=False).config


def canonical(name: str) -> str:
    """A preset name, `auto`, or ValueError listing the valid names."""
    key = names.canonical_strategy(name)
    if key not in PRESETS and key != AUTO:
        raise ValueError(f"unknown strategy {name!r}; valid strategies: {', '.join(sorted(names.STRATEGIES))}")
    return key


def build(
    name: str,
    settings: config.PhalanxConfig,
    *,
    world_size: int,
    local_world_size: int,
    cpu_offload: bool = False,
    replicate_size: int | None = None,
    shard_size: int | None = None,
) -> ParallelPlan:
    """The plan preset `name` stands for on `world_size` processes (`local_world_size` per node),
    with the model-parallel degrees `settings` (the resolved PhalanxConfig) ask for: its tp, pp and cp.

    ValueError naming the settings and the valid values when the layout cannot be built.
    """
    key = canonical(name)
    if key == AUTO and world_size == 1:
        key = SINGLE
    if key == AUTO:
        raise ValueError("strategy auto is decided from the model: call strategies.auto.decide first")
    preset = PRESETS[key]
    _check_degrees(key, preset, settings, world_size)
    if preset.threads_over_gpus:
        return ParallelPlan(preset=key, threads_over_gpus=True)
    if world_size == 1:
        return ParallelPlan(preset=SINGLE)
    tp, pp, cp = settings.tp, settings.pp, settings.cp
    dp = world_size // (tp * pp * cp)
    if preset.hybrid:
        replicate, shard = _hsdp_shape(settings, world_size, local_world_size, replicate_size, shard_size)
    elif Sharding(preset.stage) >= Sharding.GRADIENTS:
        replicate, shard = 1, dp
    else:
        replicate, shard = dp, 1
    if world_size % (tp * pp * settings.ep):
        raise _no_room_for_ep(settings, world_size)
    return ParallelPlan(
        preset=key,
        dp_replicate=replicate,
        dp_shard=shard,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=settings.ep,
        sharding=Sharding(preset.stage),
        cpu_offload=cpu_offload and Sharding(preset.stage) >= Sharding.GRADIENTS,
    )


def _check_degrees(key: str, preset: Any, settings: config.PhalanxConfig, world_size: int) -> None:
    """ValueError when the degrees `settings` ask for cannot be laid over `world_size` processes
    under the preset `key` (dp's one process among them)."""
    tp, pp, cp = settings.tp, settings.pp, settings.cp
    if preset.threads_over_gpus and tp > 1:
        raise _one_process(
            f"tp={tp} needs {tp} processes per tensor-parallel group", "ddp, zero1, zero2, zero3 or hsdp with tp"
        )
    if preset.threads_over_gpus and settings.ep > 1:
        raise _one_process(
            f"ep={settings.ep} splits the experts over {settings.ep} processes", "ddp, zero2 or zero3 with ep"
        )
    if preset.threads_over_gpus and pp > 1:
        raise _one_process(f"pp={pp} needs a process per pipeline stage", "ddp, zero1, zero2, zero3 or hsdp with pp")
    if pp > 1 and world_size % (tp * pp):
        raise _indivisible(
            "pp",
            pp,
            world_size,
            tp,
            f": each data-parallel replica needs {'pp x tp = ' if tp > 1 else 'pp = '}{tp * pp} of them",
        )
    if cp > 1:
        check_cp(key, cp, world_size=world_size, tp=tp, pp=pp)
    if world_size % tp:
        raise ValueError(
            f"tp={tp} does not divide the {world_size} processes. HINT: choose tp among "
            f"{', '.join(map(str, divisors(world_size)))}, or run a multiple of {tp} processes"
        )
    if preset.threads_over_gpus and world_size > 1:
        raise ValueError(
            f"strategy 'dp' runs in ONE process over the visible GPUs, but this job has "
            f"world_size={world_size}. HINT: use strategy='ddp' with several processes, "
            "or run the script with plain `python` for dp."
        )


def _hsdp_shape(
    settings: config.PhalanxConfig,
    world_size: int,
    local_world_size: int,
    replicate_size: int | None,
    shard_size: int | None,
) -> tuple[int, int]:
    """hsdp's (replicas, shards) of the data-parallel ranks of `world_size` processes: shards follow the nodes."""
    tp, pp, cp = settings.tp, settings.pp, settings.cp
    dp = world_size // (tp * pp * cp)
    if local_world_size % tp:
        raise ValueError(
            f"hsdp with tp={tp}: each node's {local_world_size} processes do not split into "
            f"tensor-parallel groups, so replicas and shards cannot follow the nodes. HINT: choose "
            f"tp among {', '.join(map(str, divisors(local_world_size)))}"
        )
    if local_world_size % (tp * cp):
        raise ValueError(
            f"hsdp with cp={cp}{f' x tp={tp}' if tp > 1 else ''}: each node's {local_world_size} "
            "processes do not split into context-parallel groups, so replicas and shards cannot "
            f"follow the nodes. HINT: choose cp among "
            f"{', '.join(str(d) for d in divisors(local_world_size) if (local_world_size // d) % tp == 0)}"
        )
    if pp > 1 and shard_size is None and replicate_size is None:
        # pp is the outermost dim: a stage's data-parallel ranks shard within a node, or, when
        # they are fewer than a node's processes, all of them (one replica).
        shard_size = min(local_world_size // tp, dp)
    # a node's processes hold shard x cp x tp ranks (cp and tp inside a node, as the mesh lays them)
    return hybrid_shape(dp, local_world_size, tp * cp, replicate_size, shard_size)


def decided(plan: ParallelPlan, name: str, *, cpu_offload: bool = False) -> ParallelPlan:
    """The plan of `name` (one of AUTO_CHOOSES) over `plan`'s degrees: auto's decision between
    replicas and shards of the same data-parallel ranks, made once the model is known."""
    if name not in AUTO_CHOOSES:
        raise ValueError(f"auto chooses among {', '.join(AUTO_CHOOSES)}, not {name!r}")
    if not plan.is_distributed:
        return plan
    stage = sharding(name)
    replicate, shard = (1, plan.dp_size) if stage >= Sharding.GRADIENTS else (plan.dp_size, 1)
    return ParallelPlan(
        preset=name,
        dp_replicate=replicate,
        dp_shard=shard,
        tp=plan.tp,
        pp=plan.pp,
        cp=plan.cp,
        ep=plan.ep,
        sharding=stage,
        cpu_offload=cpu_offload and stage >= Sharding.GRADIENTS,
    )


def at_scale(name: str, settings: config.PhalanxConfig) -> ParallelPlan:
    """The plan of `name` at the smallest scale its settings' layout runs in: two data-parallel ranks
    (times ep, which takes its ranks from them) at the settings' model-parallel degrees (every mesh dim
    but the data-parallel ones: tp, pp, cp): a one-process run's settings are checked there (one script,
    every scale). Auto decides between presets of the same degrees, so its first choice checks them."""
    world = 2 * settings.ep * math.prod(getattr(settings, dim, 1) for dim in MESH_DIMS if dim not in DATA_PARALLEL_DIMS)
    return build(
        AUTO_CHOOSES[0] if canonical(name) == AUTO else name, settings, world_size=world, local_world_size=world
    )


def spread_over_stage(plan: ParallelPlan) -> ParallelPlan:
    """The parameter-sharding preset with one stage's state sharded over every rank of the stage
    (tp's too): the state auto's budget test takes zero3 at rest to hold (strategies/memory_plan.py)."""
    return ParallelPlan(
        preset=AUTO_CHOOSES[-1], dp_shard=plan.stage_ranks, pp=plan.pp, sharding=sharding(AUTO_CHOOSES[-1])
    )


def larger_tp(plan: ParallelPlan, local_world_size: int) -> list[ParallelPlan]:
    """`plan`'s preset over the same processes with each larger tensor-parallel degree that stays
    within a node (`local_world_size` processes) and divides the stage's ranks: the layouts auto's
    hint tries when even zero3 does not fit."""
    found = []
    for candidate in range(plan.tp + 1, local_world_size + 1):
        if local_world_size % candidate or plan.stage_ranks % candidate:
            continue
        degrees = types.SimpleNamespace(tp=candidate, pp=plan.pp, cp=plan.cp, ep=plan.ep)
        try:
            found.append(build(plan.preset, degrees, world_size=plan.world_size, local_world_size=local_world_size))
        except ValueError:  # the data-parallel dims left do not fit (hsdp's nodes): no such layout
            continue
    return found


def check_flags(world_size: int, tp: int, pp: int, cp: int = 1) -> None:
    """`phalanx plan`'s --tp, --pp and --cp against --world-size, before any plan is built: ValueError
    naming the flags and the degrees that divide."""
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"--tp {tp} does not divide --world-size {world_size}. HINT: choose tp among "
            f"{', '.join(map(str, divisors(world_size)))}"
        )
    if pp < 1 or world_size % (tp * pp):
        fits = [d for d in divisors(world_size) if world_size % (d * tp) == 0]
        raise ValueError(
            f"--pp {pp} x --tp {tp} does not divide --world-size {world_size}. HINT: "
            f"choose pp among {', '.join(map(str, fits))}"
        )
    if cp != 1 and (cp < 1 or world_size % (cp * tp * pp)):
        fits = [d for d in divisors(world_size) if world_size % (d * tp * pp) == 0]
        raise ValueError(
            f"--cp {cp} x --tp {tp} x --pp {pp} does not divide --world-size {world_size}. HINT: "
            f"choose cp among {', '.join(map(str, fits))}"
        )


def restored(fields: Mapping[str, Any]) -> ParallelPlan:
    """The plan whose fields `phalanx run` handed over (strategies/plan/job_plan.py), unchanged."""
    fields = dict(fields)
    fields["sharding"] = Sharding(fields["sharding"])
    return ParallelPlan(**fields)


def check_cp(key: str, cp: int, *, world_size: int, tp: int, pp: int) -> None:
    """ValueError, with the fix, for a context-parallel degree the layout cannot take."""
    if PRESETS[key].threads_over_gpus:
        raise _one_process(f"cp={cp} cuts each sequence over {cp} processes", "ddp, zero1, zero2 or zero3 with cp")
    if pp > 1:
        raise ValueError(
            f"cp={cp} with pp={pp}: context parallel is not composed with pipeline stages (a stage's "
            "microbatches would need their own cut). HINT: use cp with ddp, zero1, zero2, zero3 or tp, and pp=1"
        )
    if world_size > 1 and world_size % (cp * tp):
        raise _indivisible("cp", cp, world_size, tp)


def _no_room_for_ep(settings: config.PhalanxConfig, world_size: int) -> ValueError:
    """ep takes its ranks from the data-parallel x cp ranks (the processes / (tp x pp)), never more."""
    others = settings.tp * settings.pp
    ranks = world_size // others
    fits = ", ".join(str(d) for d in divisors(ranks) if d > 1) or "none (one data-parallel rank)"
    with_others = f" (the {world_size} processes / tp x pp = {others})" if others > 1 else ""
    return ValueError(
        f"ep={settings.ep} does not divide the {ranks} data-parallel x cp ranks{with_others} it takes its "
        f"expert-parallel ranks from (ep does not add processes: the experts are split over ranks that "
        f"also hold the non-expert parameters data parallel). HINT: choose ep among {fits}, or run a "
        f"multiple of {settings.ep * others} processes"
    )


def _one_process(what: str, instead: str) -> ValueError:
    """strategy 'dp' (one process over the GPUs) asked with a degree that needs processes."""
    return ValueError(f"strategy 'dp' runs one process, and {what}. HINT: use strategy {instead}, under `phalanx run`")


def _indivisible(dim: str, degree: int, world_size: int, tp: int, why: str = "") -> ValueError:
    """A degree that, times tp, does not divide the world: the degrees that do, and the world sizes that fit."""
    with_tp = f" x tp={tp}" if tp > 1 else ""
    fits = [d for d in divisors(world_size) if (world_size // d) % tp == 0]
    return ValueError(
        f"{dim}={degree}{with_tp} does not divide the {world_size} processes{why}. HINT: choose {dim} "
        f"among {', '.join(map(str, fits))}{f' (with tp={tp})' if tp > 1 else ''}, or run a multiple of "
        f"{degree * tp} processes"
    )


def hybrid_shape(
    dp_size: int, local_world_size: int, tp: int = 1, replicate_size: int | None = None, shard_size: int | None = None
) -> tuple[int, int]:
    """hsdp's (replicate, shard) degrees over `dp_size` data-parallel ranks; by default one replica
    per node, sharded over the node's processes (after tensor parallel took `tp` of them)."""
    for label, value in (("replicate_size", replicate_size), ("shard_size", shard_size)):
        if value is not None and (int(value) != value or value < 1):
            raise ValueError(f"hsdp: strategy_options {label}={value!r} must be a positive integer")
    if shard_size is None:
        shard_size = dp_size // replicate_size if replicate_size else max(local_world_size // tp, 1)
    if replicate_size is None:
        replicate_size = dp_size // shard_size if dp_size % shard_size == 0 else 0
    if replicate_size * shard_size != dp_size:
        with_tp = f" after tp={tp}" if tp > 1 else ""
        raise ValueError(
            f"hsdp: a mesh of replicate_size={replicate_size} x shard_size={shard_size} does not cover "
            f"the {dp_size} data-parallel ranks{with_tp} (local world size {local_world_size}). HINT: set "
            f"strategy_options={{'replicate_size': R, 'shard_size': S}} with R * S == {dp_size} (world size / (tp x pp))."
        )
    return int(replicate_size), int(shard_size)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
