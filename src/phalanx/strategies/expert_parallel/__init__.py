"""Expert parallel (`ep`): each MoE layer's experts split over `plan.ep` ranks, tokens sent to them.

The ep ranks are taken from the gradient ranks (data-parallel x cp, the innermost `ep` of them:
`layout.mesh("ep")`), as torchtitan takes them from dp_shard x cp: ep adds no process. The
non-expert parameters stay data parallel over all of those ranks (DDP); the experts modules the
model's `base_model_ep_plan` (or `strategy_options={"ep_plan": ...}`) names keep only this rank's
slice of their 3-D weights (experts [r * E/ep, (r+1) * E/ep)), are left out of DDP, and run their
tokens through `Dispatch` (dispatch.py).

Gradients, so that a step equals one process. Each of the N gradient ranks computes its loss L_r as
the mean over its own tokens, and data parallel averages: the one-process gradient is
(1/N) sum_r dL_r/dW. An expert's weights on rank e receive, through the all-to-all's backward, the
gradient of the losses of every rank of its ep group: sum over those ep ranks of dL_r/dW. The
groups of ep ranks are N/ep copies of each expert (`ep_replicate`), each summing its own group's
ranks; so the one-process gradient is (1/N) x the sum over the copies = (1/ep) x their mean. Each
expert gradient is divided by ep as it arrives and averaged over its copies (when there are any).

Gradient clipping: torch's `clip_grad_norm_` on the prepared model (and `px.clip_grad_norm_`) gets
the norm over every expert: this rank's expert gradients' p-th powers summed over the ep ranks, with
the data-parallel gradients' norm (the same on every rank). Full weights (`px.get_state_dict`) gather
each expert weight back to its one-process shape.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies.expert_parallel import ep_plan
from phalanx.strategies.expert_parallel.dispatch import Dispatch
from phalanx.strategies.grad_norm import total_norm
from phalanx.strategies.layout import Layout
from phalanx.strategies.parallel_plan import Sharding


class ExpertParallel:
    """The experts of one prepared model, split over this rank's ep group."""

    def __init__(self, model: nn.Module, layout: Layout, user_plan: Mapping[str, str] | None = None):
        plan = layout.plan
        _refuse_compositions(model, layout)
        found = ep_plan.find(model, ep_plan.model_plan(model, user_plan), plan)
        self.ranks = plan.ep
        self.group = layout.group("ep")
        self.copies = layout.group("ep_replicate") if plan.ep_replicate > 1 else None
        rank = layout.mesh("ep").get_local_rank()
        self.names: list[str] = []  # full names (in `model`) of the split weights
        self._grads: set[int] = set()  # ids of the split weights, whose gradients are partial norms
        for experts in found:
            local = experts.num_experts // self.ranks
            for name in experts.params:
                param = experts.module.get_parameter(name)
                # the same Parameter keeps its place in an optimizer built before prepare
                param.data = param.data[rank * local:(rank + 1) * local].clone()
                param.register_hook(self._reduce)
                self.names.append(f"{experts.name}.{name}")
                self._grads.add(id(param))
            if hasattr(experts.module, "num_experts"):
                experts.module.num_experts = local  # the model's forward counts its local experts
            experts.module.forward = Dispatch(experts.module.forward, self.group, self.ranks, local)
        self.params = [model.get_parameter(name) for name in self.names]
        # DDP leaves them alone: their gradients are reduced here, over the ranks holding the same experts
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) + self.names
        model._ddp_params_and_buffers_to_ignore = ignored

    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad / self.ranks
        if self.copies is not None:
            dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=self.copies)
        return grad

    def norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The norm of `grads` (torch's clip_grad_norm_ routes here) with every rank's experts counted once."""
        owned = {id(p.grad) for p in self.params if p.grad is not None}
        experts = [g for g in grads if id(g) in owned]
        part = total_norm(experts, norm_type).float() if experts else torch.tensor(0.0)
        part = part.to(grads[0].device) if grads else part
        if math.isinf(norm_type):
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=self.group)
        else:
            part = part ** norm_type
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group)
        rest = total_norm([g for g in grads if id(g) not in owned], norm_type).float().to(part.device)
        if math.isinf(norm_type):
            return torch.maximum(part, rest)
        return (part + rest ** norm_type) ** (1.0 / norm_type)

    def full(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (this rank's state dict) with each split weight gathered whole (every rank joins)."""
        state = dict(state)
        for name in self.names:
            if name not in state:
                continue
            local = state[name].detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(self.ranks)]
            dist.all_gather(parts, local, group=self.group)
            state[name] = torch.cat(parts)
        return state


def _refuse_compositions(model: nn.Module, layout: Layout) -> None:
    """ValueError for the layouts ep is not composed with yet (each with what runs instead)."""
    plan = layout.plan
    kind, where = type(model).__name__, plan.describe()
    if plan.tp > 1 or plan.pp > 1:
        raise ValueError(f"ep={plan.ep} ({where}) with {'tp' if plan.tp > 1 else 'pp'}: expert parallel is not composed "
                         f"with tensor or pipeline parallel yet, so {kind}'s experts cannot be laid out. HINT: use ep with "
                         "ddp alone (tp=1, pp=1), or tp/pp without ep")
    if plan.sharding is Sharding.OPTIMIZER or plan.uses_fsdp:
        raise ValueError(f"ep={plan.ep} ({where}): expert parallel is composed with ddp only so far; under "
                         f"{plan.preset} the data-parallel ranks would shard {kind}'s experts as if every rank held the same "
                         "ones. HINT: use strategy ddp with ep, or zero2/zero3 without ep")


def apply(model: nn.Module, layout: Layout, user_plan: Mapping[str, str] | None = None) -> ExpertParallel | None:
    """Split `model`'s experts over the layout's ep ranks (before data parallel wraps it); None when ep is 1."""
    if layout.plan.ep == 1:
        return None
    return ExpertParallel(model, layout, user_plan)


__all__ = ["ExpertParallel", "apply"]
