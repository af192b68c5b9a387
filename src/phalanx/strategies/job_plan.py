"""The job's one parallel plan, built once per process and handed on whole.

`phalanx run` builds the plan from the settings before any worker starts and hands it to its
workers in one variable (PHALANX_PLAN): the plan and what it was built from. A worker adopts it when
its own settings ask for the same thing (the same strategy, degrees, world and strategy options);
otherwise (torchrun, plain python, a script that passes another layout to `Phalanx()`) it builds
the plan itself, once. Strategy auto's plan is the one of its degrees (auto's first choice, ddp);
auto then decides between replicas and shards of those degrees (presets.decided), never rebuilding.

Pure Python (no torch): the launcher imports it.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from phalanx.strategies import presets
from phalanx.strategies.parallel_plan import DEGREES, ParallelPlan, Sharding


def inputs(strategy: str, settings: Any, *, world_size: int, local_world_size: int,
           cpu_offload: bool = False, replicate_size: int | None = None,
           shard_size: int | None = None) -> dict[str, Any]:
    """What `presets.build` makes the plan from, as JSON-able values: two equal inputs build equal plans.
    `settings`: the resolved PhalanxConfig (its mesh-dimension settings: tp, pp)."""
    name = presets.canonical(strategy)
    return {"strategy": presets.AUTO_CHOOSES[0] if name == presets.AUTO else name,
            **{dim: getattr(settings, dim) for dim in DEGREES if hasattr(settings, dim)},
            "world_size": world_size, "local_world_size": local_world_size, "cpu_offload": bool(cpu_offload),
            "replicate_size": replicate_size, "shard_size": shard_size}


def build(strategy: str, settings: Any, **where: Any) -> ParallelPlan:
    """The plan of `inputs(strategy, settings, **where)` (auto: the plan of its degrees)."""
    given = inputs(strategy, settings, **where)
    return presets.build(given["strategy"], settings, world_size=given["world_size"],
                         local_world_size=given["local_world_size"], cpu_offload=given["cpu_offload"],
                         replicate_size=given["replicate_size"], shard_size=given["shard_size"])


def hand_off(plan: ParallelPlan, given: Mapping[str, Any]) -> str:
    """The PHALANX_PLAN value a worker reads: the plan and the inputs it was built from."""
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    fields["sharding"] = int(plan.sharding)
    return json.dumps({"inputs": dict(given), "plan": fields}, sort_keys=True)


def received(given: Mapping[str, Any], text: str) -> ParallelPlan | None:
    """The plan the launcher handed this process (`text`: PHALANX_PLAN, read by runtime/context.py),
    when it was built from `given`; None otherwise."""
    if not text:
        return None
    data = json.loads(text)
    if data["inputs"] != json.loads(json.dumps(dict(given))):
        return None
    fields = dict(data["plan"])
    fields["sharding"] = Sharding(fields["sharding"])
    return ParallelPlan(**fields)


def plan_for(strategy: str, settings: Any, handed_text: str = "", **where: Any) -> ParallelPlan:
    """This process's plan: the one handed over (`handed_text`) for the same inputs, else built here."""
    handed = received(inputs(strategy, settings, **where), handed_text)
    return handed if handed is not None else build(strategy, settings, **where)
