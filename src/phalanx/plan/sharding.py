"""`phalanx plan`'s rows as parallel plans: every multi-process preset built over the same degrees
(strategies/presets.py), and each row's per-rank bytes computed from what its plan shards, not from
a table of strategy names. Figures are one tensor-parallel rank's part of one pipeline rank's
stages (`sizes`), spread over the plan's data-parallel ranks."""
from __future__ import annotations

from typing import Any

from phalanx.model import memory
from phalanx.model.memory import ParamSize, RankBytes
from phalanx.strategies import presets
from phalanx.strategies.parallel_plan import ParallelPlan, Sharding

PERSISTENT = "-persistent"  # zero1 with zero1_gather persistent: its gather buffers kept between steps
OFFLOAD = "-offload"  # the preset with cpu_offload (the parameter-sharding presets only)


def layouts(settings: Any, *, world_size: int, local_world_size: int) -> dict[str, ParallelPlan]:
    """Row name -> plan: each preset that runs several processes, over the degrees `settings` ask for
    (tp, pp), in the order of the presets table, with the zero1_gather and cpu_offload variants
    after their preset. A preset whose layout cannot be built on these processes (hsdp's replicas
    not fitting the nodes) has no row."""
    rows: dict[str, ParallelPlan] = {}
    for name in presets.multi_process():
        try:
            plan = presets.build(name, settings, world_size=world_size, local_world_size=local_world_size)
        except ValueError:
            continue
        rows[name] = plan
        if plan.sharding is Sharding.OPTIMIZER:
            rows[name + PERSISTENT] = plan
        if plan.sharding >= Sharding.PARAMETERS and not presets.PRESETS[name].hybrid:
            rows[name + OFFLOAD] = presets.build(name, settings, world_size=world_size,
                                                 local_world_size=local_world_size, cpu_offload=True)
    return rows


def rank_bytes(sizes: list[ParamSize], plan: ParallelPlan, optimizer: str = "adamw", *,
               persistent_gather: bool = False, runtime: int = 0) -> list[RankBytes]:
    """Per data-parallel rank, the model state it holds at rest under `plan`: whole (replicas), the
    optimizer state split over the replicas (zero1), or dim-0 shards over the shard dim (zero2, zero3,
    hsdp), in CPU memory with cpu_offload; plus `runtime` (memory.runtime_bytes), the process's own.
    Whole gradients count at their own shape (memory.GRAD_SHAPE_ATTR: tp's row-split embedding)."""
    ranks = range(max(plan.dp_size, 1))
    whole = memory.sharded_bytes(sizes, 1, 0, optimizer)
    grads = sum(s.grad_nbytes for s in sizes)
    if plan.sharding is Sharding.NONE:
        return [RankBytes(whole.params, grads, whole.optimizer, runtime=runtime) for _ in ranks]
    if plan.sharding is Sharding.OPTIMIZER:
        buffers = memory.zero1_gather_buffer_bytes(sizes, plan.dp_size) if persistent_gather else 0
        return [RankBytes(whole.params, grads,
                          sum(memory.zero1_optimizer_bytes(s, plan.dp_size, r, optimizer) for s in sizes),
                          buffers=buffers, runtime=runtime)
                for r in ranks]
    shards = [memory.sharded_bytes(sizes, plan.dp_shard, r % plan.dp_shard, optimizer) for r in ranks]
    if plan.cpu_offload:
        return [RankBytes(host=b.total, runtime=runtime) for b in shards]
    return [RankBytes(b.params, b.grads, b.optimizer, runtime=runtime) for b in shards]


def table(sizes: list[ParamSize], rows: dict[str, ParallelPlan], optimizer: str = "adamw",
          runtime: int = 0) -> dict[str, list[RankBytes]]:
    """Row name -> per-rank bytes, for `layouts`' rows."""
    return {name: rank_bytes(sizes, plan, optimizer, persistent_gather=name.endswith(PERSISTENT), runtime=runtime)
            for name, plan in rows.items()}
