"""The job's one parallel plan, built once per process and handed on whole.

`phalanx run` builds the plan from the settings before any worker starts and hands it to its
workers in one variable (PHALANX_PLAN): the plan and what it was built from, one per membership the
job may have (an elastic job's every node count, so a membership of another size adopts its own). A
worker adopts the one built from what its own settings ask (the same strategy, degrees, world and
strategy options); with none handed (torchrun, plain python) it builds the plan itself, once, and
where the launcher handed plans for other inputs (a script that passes another layout to
`Phalanx()`) it says so in its log and builds its own, once. Strategy auto's plan is the one of its degrees (auto's first choice, ddp);
auto then decides between replicas and shards of those degrees (presets.decided), never rebuilding.

Pure Python (no torch): the launcher imports it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping

from phalanx.logging.rank_log import get_logger
from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import DEGREES, ParallelPlan


def inputs(
    strategy: str,
    settings: Any,
    *,
    world_size: int,
    local_world_size: int,
    cpu_offload: bool = False,
    replicate_size: int | None = None,
    shard_size: int | None = None,
) -> dict[str, Any]:
    """What `presets.build` makes the plan from, as JSON-able values: two equal inputs build equal plans.
    `settings`: the resolved PhalanxConfig (its mesh-dimension settings: tp, pp)."""
    name = presets.canonical(strategy)
    return {
        "strategy": presets.AUTO_CHOOSES[0] if name == presets.AUTO else name,
        **{dim: getattr(settings, dim) for dim in DEGREES if hasattr(settings, dim)},
        "world_size": world_size,
        "local_world_size": local_world_size,
        "cpu_offload": bool(cpu_offload),
        "replicate_size": replicate_size,
        "shard_size": shard_size,
    }


def build(strategy: str, settings: Any, **where: Any) -> ParallelPlan:
    """The plan of `inputs(strategy, settings, **where)` (auto: the plan of its degrees)."""
    given = inputs(strategy, settings, **where)
    return presets.build(
        given["strategy"],
        settings,
        world_size=given["world_size"],
        local_world_size=given["local_world_size"],
        cpu_offload=given["cpu_offload"],
        replicate_size=given["replicate_size"],
        shard_size=given["shard_size"],
    )


def hand_off(plans: Iterable[tuple[ParallelPlan, Mapping[str, Any]]]) -> str:
    """The PHALANX_PLAN value a worker reads: each plan with the inputs it was built from, one per
    membership the job may have (an elastic job's node counts)."""
    handed = []
    for plan, given in plans:
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
        fields["sharding"] = int(plan.sharding)
        handed.append({"inputs": dict(given), "plan": fields})
    return json.dumps({"plans": handed}, sort_keys=True)


def _handed(text: str) -> list[dict[str, Any]]:
    return json.loads(text)["plans"] if text else []


def received(given: Mapping[str, Any], text: str) -> ParallelPlan | None:
    """The plan the launcher handed this process (`text`: PHALANX_PLAN, read by runtime/context.py)
    for the inputs `given`; None when it handed none for them."""
    asked = json.loads(json.dumps(dict(given)))
    for entry in _handed(text):
        if entry["inputs"] == asked:
            return presets.restored(entry["plan"])
    return None


def plan_for(strategy: str, settings: Any, handed_text: str = "", **where: Any) -> ParallelPlan:
    """This process's plan: the one handed over (`handed_text`) for the same inputs; built here when
    nothing was handed (torchrun, plain python), and rebuilt, with a log line naming why, when the
    launcher handed plans for other inputs (the script asks another layout than `phalanx run`'s)."""
    given = inputs(strategy, settings, **where)
    handed = received(given, handed_text)
    if handed is not None:
        return handed
    if handed_text:
        get_logger().info("this process builds its own parallel plan: %s", differs(given, _handed(handed_text)))
    return build(strategy, settings, **where)


def differs(given: Mapping[str, Any], handed: list[dict[str, Any]]) -> str:
    """What this process asks that no handed plan was built from: `strategy zero3 (launcher: ddp)`."""
    closest = min(
        (entry["inputs"] for entry in handed), key=lambda other: sum(other.get(k) != v for k, v in given.items())
    )
    return ", ".join(
        f"{key} {value} (launcher: {closest.get(key)})" for key, value in given.items() if closest.get(key) != value
    )
