"""`phalanx plan --ep N`: what expert parallel puts on each rank, beside the strategies' rows (the
flag comes from the plan's DEGREES, these lines through strategies/dimensions.py's `plan_lines`).

Under ep each MoE layer's experts are split over N ranks (their dim 0, the expert index), and the
rest of the model is laid out as the strategy says (whole under ddp, sharded under zero2/zero3) over
the data-parallel ranks, from which ep takes its ranks. The experts are found as prepare finds them
(the model's `base_model_ep_plan`), on the model built on the meta device."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Callable

from phalanx.strategies.plan import presets

if TYPE_CHECKING:
    from phalanx.model.memory import ParamSize


def report(
    args: argparse.Namespace, model: Any, sizes: list[ParamSize], optimizer: str, fb: Callable[[float], str]
) -> str:
    """The lines to print under the table ('' without ep); ValueError as prepare would refuse."""
    if args.ep == 1:
        return ""
    from phalanx.model import memory
    from phalanx.strategies.expert_parallel import ep_plan

    plan = presets.build(
        presets.AUTO_CHOOSES[0],
        presets.asking(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep),
        world_size=args.world_size,
        local_world_size=args.nproc_per_node or args.world_size,
    )
    found = ep_plan.find(model, ep_plan.model_plan(model, None), plan)
    split = {f"{e.name}.{p}" for e in found for p in e.params}
    experts = [s for s in sizes if s.name in split]
    rest = [s for s in sizes if s.name not in split]

    def at_rest(part: list[ParamSize], ranks: int) -> int:  # the largest rank's dim-0 share, with state
        return max(memory.sharded_bytes(part, ranks, r, optimizer).total for r in range(ranks))

    ranks = plan.grad_size
    mine, whole, sharded = at_rest(experts, plan.ep), at_rest(experts, 1), at_rest(experts, ranks)
    rest_whole, rest_sharded = at_rest(rest, 1), at_rest(rest, ranks)
    layers = f"{len(found)} MoE layer(s) x {found[0].num_experts} experts"
    return "\n".join(
        [
            f"expert parallel, ep {plan.ep} of the {ranks} data-parallel ranks ({layers}), per rank at rest with "
            f"{optimizer} (parameters, gradients, optimizer state):",
            f"  experts: {fb(mine)} under ep {plan.ep} ({fb(whole)} under ddp, {fb(sharded)} under zero3)",
            f"  the rest: {fb(rest_whole)} under ddp, {fb(rest_sharded)} under zero2/zero3",
            f"  ep {plan.ep} x ddp: {fb(mine + rest_whole)} per rank; ep {plan.ep} x zero3: {fb(mine + rest_sharded)}",
        ]
    )
