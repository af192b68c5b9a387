"""The one per-rank memory model, keyed by the parallel plan: the model-state bytes each rank holds
under a plan, from what the plan shards, never from a table of strategy names. Strategy auto
(strategies/auto.py), `phalanx plan` (plan/sharding.py, plan/command.py, plan/context.py) and the
tests that compare `px.memory_report` with it all ask here.

model/memory.py holds the arithmetic of one parameter (its dim-0 chunk, its optimizer state, zero1's
gather buffer) and the measurement of a real rank; this module lays that over a plan's ranks.
"""

from __future__ import annotations

from phalanx.config import names
from phalanx.model import memory
from phalanx.model.memory import ParamSize, RankBytes
from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import ParallelPlan, Sharding


def rank_bytes(
    sizes: list[ParamSize],
    plan: ParallelPlan,
    optimizer: str = "adamw",
    *,
    persistent_gather: bool = False,
    runtime: int = 0,
) -> list[RankBytes]:
    """Per rank of the gradient group (the data-parallel x cp ranks), the model state it holds at rest
    under `plan`: whole (replicas), the optimizer state split over the group (zero1), or dim-0 shards
    over FSDP2's shard dim (zero2, zero3, hsdp), in CPU memory with cpu_offload; plus `runtime`
    (memory.runtime_bytes), the process's own. `sizes`: the parameters one rank of the plan's
    tensor-parallel group and pipeline stage holds. Whole gradients count at their own shape
    (memory.GRAD_SHAPE_ATTR: tp's row-split embedding). `persistent_gather`: zero1_gather persistent."""
    ranks = range(plan.grad_size)
    whole = memory.sharded_bytes(sizes, 1, 0, optimizer)
    grads = sum(s.grad_nbytes for s in sizes)
    if plan.sharding is Sharding.NONE:
        return [RankBytes(whole.params, grads, whole.optimizer, runtime=runtime) for _ in ranks]
    if plan.sharding is Sharding.OPTIMIZER:
        buffers = memory.zero1_gather_buffer_bytes(sizes, plan.grad_size) if persistent_gather else 0
        return [
            RankBytes(
                whole.params,
                grads,
                sum(memory.zero1_optimizer_bytes(s, plan.grad_size, r, optimizer) for s in sizes),
                buffers=buffers,
                runtime=runtime,
            )
            for r in ranks
        ]
    shards = [memory.sharded_bytes(sizes, plan.shard_ranks, r % plan.shard_ranks, optimizer) for r in ranks]
    if plan.cpu_offload:
        return [RankBytes(host=b.total, runtime=runtime) for b in shards]
    return [RankBytes(b.params, b.grads, b.optimizer, runtime=runtime) for b in shards]


def recommend(
    sizes: list[ParamSize],
    plan: ParallelPlan,
    budget_bytes: int,
    optimizer: str = "adamw",
    *,
    one_tp_rank: bool = False,
) -> tuple[str, str]:
    """What `auto` picks over `plan`'s data-parallel ranks, and why: its replicating preset when that
    preset's per-rank state fits the budget, else its sharding one. `sizes` are the whole model's
    (the state taken as split evenly over the plan's tp ranks: an estimate, layers the tp plan leaves
    whole are not split), or, with `one_tp_rank`, one tensor-parallel rank's (`phalanx plan --tp`)."""
    if plan.grad_size == 1 and plan.tp == 1:
        return names.SINGLE, "world_size is 1: nothing to distribute"
    replicas, shards = names.AUTO_CHOOSES
    need = rank_bytes(sizes, presets.decided(plan, replicas), optimizer)[0].total
    split = plan.tp > 1 and not one_tp_rank
    if split:
        need = plan.tp_part(need)
    with_tp = f" (state split over tp={plan.tp})" if split else ""
    if need <= budget_bytes:
        return replicas, (
            f"{replicas} needs {memory.format_bytes(need)} per rank{with_tp}, within the "
            f"{memory.format_bytes(budget_bytes)} budget"
        )
    return shards, (
        f"{replicas} would need {memory.format_bytes(need)} per rank{with_tp}, over the "
        f"{memory.format_bytes(budget_bytes)} budget: sharding with {shards}"
    )


def zero3_peak(
    sizes: list[ParamSize], plan: ParallelPlan, largest_unit_bytes: int, optimizer: str = "adamw"
) -> tuple[int, int]:
    """(model state at rest, + the largest unit's gathered parameters) per rank under the sharding
    preset over one stage's ranks (the state taken as sharded over all of them, tp's included), each
    gathered unit split over the plan's tp ranks. `sizes`: the whole model's (one stage's under pp)."""
    at_rest = max(b.total for b in rank_bytes(sizes, presets.spread_over_stage(plan), optimizer))
    return at_rest, at_rest + plan.tp_part(largest_unit_bytes)


def tp_that_fits(
    sizes: list[ParamSize],
    plan: ParallelPlan,
    local_world_size: int,
    budget_bytes: int,
    largest_unit_bytes: int,
    optimizer: str = "adamw",
) -> str:
    """When zero3 over every rank does not fit the budget: which tensor-parallel degree (within a
    node) would, or why none can; "" when zero3 fits as it is."""
    at_rest, peak = zero3_peak(sizes, plan, largest_unit_bytes, optimizer)
    if peak <= budget_bytes:
        return ""
    if at_rest > budget_bytes:
        return (
            f"even zero3 over all {plan.stage_ranks} ranks holds {memory.format_bytes(at_rest)} of model state "
            f"per rank, over the {memory.format_bytes(budget_bytes)} budget: use more ranks or strategy_options "
            "cpu_offload"
        )
    for larger in presets.larger_tp(plan, local_world_size):
        if zero3_peak(sizes, larger, largest_unit_bytes, optimizer)[1] <= budget_bytes:
            return (
                f"zero3 peaks at {memory.format_bytes(peak)} per rank with a block gathered, over the "
                f"{memory.format_bytes(budget_bytes)} budget; tp={larger.tp} would fit (each gathered block "
                f"split {larger.tp} ways within a node): set tp={larger.tp} (phalanx run --tp {larger.tp})"
            )
    return (
        f"zero3 peaks at {memory.format_bytes(peak)} per rank with a block gathered, over the "
        f"{memory.format_bytes(budget_bytes)} budget, and no tensor-parallel degree within a node brings it under"
    )
