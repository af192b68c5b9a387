"""An opt-in capacity per expert (`strategy_options={"capacity_factor": 1.25}`), as Switch and GShard
drop: each expert of an ep group takes at most

    capacity = ceil(capacity_factor x choices / experts)

token-choices in one forward of one MoE layer, where `choices` is tokens x top_k over every rank of
the ep group (this layer's global tokens of the group) and `experts` the layer's number of experts.
Each expert takes the choices in the group's order: rank 0's first, then rank 1's, ...; within a
rank, token by token (the flattened batch x sequence), each token's choices in their top-k order.
The choices past the capacity are dropped: not sent, not computed, they add zero to their token
(whose other choices keep their router weights), and their router weights get no gradient.

The drops are counted per layer over every forward of an optimizer step (its accumulation
micro-steps together) and read after the step: `px.moe_dropped_tokens`, and one INFO line
`moe/dropped_tokens` on the main process. Without a capacity factor nothing is dropped or counted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import torch
import torch.distributed as dist

from phalanx.logging.rank_log import get_logger

KEY = "capacity_factor"  # its name in strategy_options and in a user ep_plan


def factor(option: Any, user_plan: Mapping[str, Any] | None, where: str) -> float | None:
    """The capacity factor asked for (strategy_options' or the ep_plan's `capacity_factor`), checked;
    None: no capacity, nothing dropped."""
    planned = (user_plan or {}).get(KEY)
    if option is not None and planned is not None and option != planned:
        raise ValueError(
            f"ep ({where}): capacity_factor is given twice, {option!r} in strategy_options and {planned!r} in "
            "ep_plan. HINT: give it once"
        )
    value = option if option is not None else planned
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 or math.isinf(value):
        raise ValueError(
            f"ep ({where}): capacity_factor={value!r} is not a positive number. HINT: give e.g. 1.25 (each "
            "expert takes at most ceil(1.25 x tokens x top_k / experts) token-choices), or None to drop none"
        )
    return float(value)


def keep(experts: torch.Tensor, rank: int, ranks: int, num_experts: int, capacity_factor: float, group: Any):
    """Which of this rank's choices (`experts`: each choice's expert, in order) the capacity keeps.

    Returns (kept: the indices into `experts` of the kept choices, sorted by expert, stable;
    kept_counts [ranks, num_experts]: what each rank of the group keeps for each expert; dropped:
    the group's dropped choices in this forward)."""
    counts = torch.bincount(experts, minlength=num_experts)
    every = [torch.empty_like(counts) for _ in range(ranks)]
    dist.all_gather(every, counts, group=group)  # every rank's choices per expert
    asked = torch.stack(every)  # [ranks, experts]
    capacity = math.ceil(capacity_factor * int(asked.sum()) / num_experts)
    before = asked.cumsum(0) - asked  # the choices of the lower ranks, taken first
    kept_counts = torch.minimum((capacity - before).clamp_min(0), asked)
    order = torch.argsort(experts, stable=True)
    by_expert = experts[order]
    # each choice's place among this rank's choices for the same expert, then among the group's
    place = torch.arange(order.numel(), device=experts.device) - (counts.cumsum(0) - counts)[by_expert]
    taken = before[rank][by_expert] + place < capacity
    return order[taken], kept_counts, int((asked - kept_counts).sum())


class Drops:
    """The token-choices dropped per layer in the current optimizer step, and in the last one."""

    def __init__(self, device: torch.device, copies: Any = None, log: bool = False):
        self.device = device  # where the copies' sum runs (NCCL: the GPU)
        self.copies = copies  # ep_replicate's group: the other ep groups' drops are summed in
        self.log = log  # the main process says each step's count
        self.current: dict[str, int] = {}
        self.last: dict[str, int] = {}

    def add(self, layer: str, dropped: int) -> None:
        """One training forward's drops of `layer` (forwards without gradients, evaluation, are not counted)."""
        if torch.is_grad_enabled():
            self.current[layer] = self.current.get(layer, 0) + dropped

    def end_step(self, *_: Any) -> None:
        """After an optimizer step: its counts become the last step's (over every copy of the experts)."""
        names = sorted(self.current)
        if self.copies is not None and names:
            summed = torch.tensor([self.current[n] for n in names], dtype=torch.int64, device=self.device)
            dist.all_reduce(summed, group=self.copies)
            self.current = dict(zip(names, summed.tolist()))
        self.last, self.current = self.current, {}
        if self.log:
            get_logger("expert_parallel").info(
                "moe/dropped_tokens %d (%s)",
                sum(self.last.values()),
                ", ".join(f"{n}: {c}" for n, c in sorted(self.last.items())) or "no MoE forward",
            )
