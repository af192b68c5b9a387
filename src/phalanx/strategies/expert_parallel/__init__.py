"""Expert parallel (`ep`): each MoE layer's experts split over `plan.ep` ranks, tokens sent to them.

The ep ranks are taken from the gradient ranks (data-parallel x cp, the innermost `ep` of them:
`layout.mesh("ep")`), as torchtitan takes them from dp_shard x cp: ep adds no process. The
non-expert parameters stay data parallel over all of those ranks (DDP, or FSDP2 under zero2/zero3);
the experts modules the model's `base_model_ep_plan` (or `strategy_options={"ep_plan": ...}`) names
keep only this rank's slice of their 3-D weights (experts [r * E/ep, (r+1) * E/ep)), are left out
of DDP/FSDP2, and run their tokens through `Dispatch` (dispatch.py).

Gradients, so that a step equals one process. Each of the N gradient ranks computes its loss L_r as
the mean over its own tokens, and data parallel averages: the one-process gradient is
(1/N) sum_r dL_r/dW. An expert's weights on rank e receive, through the all-to-all's backward, the
gradient of the losses of every rank of its ep group: sum over those ep ranks of dL_r/dW. The
groups of ep ranks are N/ep copies of each expert (`ep_replicate`), each summing its own group's
ranks; so the one-process gradient is (1/N) x the sum over the copies = (1/ep) x their mean. Each
expert gradient is divided by ep as it arrives and averaged over its copies (when there are any).

Under pp (outermost), the ep ranks are each stage's data-parallel ranks (`layout.mesh("ep")`): every
expert is split before the model is cut into stages, each stage's ranks run the same microbatches,
so their all-to-alls pair up; torch's clip_grad_norm_ takes the pipeline's norm (each stage's, DTensor
experts included, summed over the stages).

Under tp (innermost), the ep ranks are the gradient ranks sharing a tp coordinate: the tp ranks of
an ep rank hold the same tokens, route them alike and send them to the ep ranks of their own tp
coordinate. Tensor parallel splits the experts first (tp_experts.py, transformers' `packed_colwise`,
`rowwise` and `moe_tp_experts`, whose forward sums the partial outputs over tp); the split here runs
after it (`after_tp`) and keeps this rank's experts of its tp part, on the 2-D mesh ep x tp
(`layout.mesh("ep_tp")`). Dispatch calls tp's forward on the received rows; the tp parts are different
weights, so the gradients reduce as above, over the ep ranks of one tp coordinate and their copies.

The split weights are DTensors of the one-process shape, sharded on dim 0 over the ep ranks (the
experts forward runs on their local parts): a DCP checkpoint stores every expert under its
one-process name (read in one process with no group, resumed under the same layout: tested), and
optimizer states follow. torch's
`clip_grad_norm_` on the prepared model (and `px.clip_grad_norm_`) gets the norm of every kind
together (pipeline/grads.py's route, grad_norm.total_norm); full weights (`px.get_state_dict`)
gather each expert weight whole.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from phalanx.strategies.expert_parallel import capacity, ep_plan
from phalanx.strategies.expert_parallel.dispatch import Dispatch
from phalanx.strategies.optimizers.grad_norm import total_norm
from phalanx.strategies.layout import Layout
from phalanx.strategies.plan.parallel_plan import ParallelPlan


class ExpertParallel:
    """The experts of one prepared model, split over this rank's ep group."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        device: torch.device,
        user_plan: Mapping[str, Any] | None = None,
        capacity_factor: float | None = None,
    ):
        plan = layout.plan
        _refuse_compositions(model, layout)
        found = ep_plan.find(model, ep_plan.model_plan(model, user_plan), plan)
        self.ranks = plan.ep
        self.group = layout.group("ep")
        self.copies = layout.group("ep_replicate") if plan.ep_replicate > 1 else None
        self.capacity_factor = capacity.factor(capacity_factor, user_plan, plan.describe())
        # the token-choices a capacity dropped, per layer and step (counted only under a capacity factor)
        self.drops = capacity.Drops(device, self.copies, log=layout.root.get_rank() == 0)
        self._counting = False  # an optimizer's steps end the drops' steps
        rank = layout.mesh("ep").get_local_rank()
        self.names: list[str] = []  # full names (in `model`) of the split weights
        for experts in found:
            local = experts.num_experts // self.ranks
            for name in experts.params:
                param = experts.module.get_parameter(name)
                mesh, placements, whole = _laid_out(param, layout, f"{experts.name}.{name}", kind=type(model).__name__)
                # this rank's experts, on the device (FSDP2 leaves the parameters it ignores where they
                # are), as a DTensor of the one-process shape: checkpoints store every expert under its
                # one-process name, and optimizer states follow the same layout
                part = whole[rank * local : (rank + 1) * local].to(device, copy=True)
                split = nn.Parameter(
                    DTensor.from_local(part, mesh, placements, run_check=False), requires_grad=param.requires_grad
                )
                experts.module.register_parameter(name, split)
                self.names.append(f"{experts.name}.{name}")
            if hasattr(experts.module, "num_experts"):
                experts.module.num_experts = local  # the model's forward counts its local experts
            experts.module.forward = Dispatch(
                experts.module,
                experts.params,
                self.group,
                self.ranks,
                local,
                self._reduce,
                rank,
                self.capacity_factor,
                functools.partial(self.drops.add, experts.name),
            )
        _generate_in_step(model)
        # DDP leaves them alone: their gradients are reduced here, over the ranks holding the same experts
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) + self.names
        model._ddp_params_and_buffers_to_ignore = ignored

    def count_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Under a capacity factor, the drops are the step's from `optimizer`'s steps on (the first one given)."""
        if self.capacity_factor is not None and not self._counting:
            self._counting = True
            optimizer.register_step_post_hook(self.drops.end_step)

    def dropped_tokens(self) -> dict[str, int]:
        """Under a capacity factor, each MoE layer's token-choices dropped in the last optimizer step."""
        return dict(self.drops.last)

    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of one use of this rank's part of a split weight, as one process's (above)."""
        grad = grad / self.ranks
        if self.copies is not None:
            dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=self.copies)
        return grad

    def norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The norm of `grads` (torch's clip_grad_norm_ routes here): plain, FSDP2's and the experts'
        DTensor gradients, each mesh's reduced over its own ranks (every expert counted once)."""
        return total_norm(grads, norm_type)

    def full(self, state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        """`state` with each split weight of `model` gathered whole where it holds one (every rank joins:
        under zero2/zero3 only the main process's `state` holds weights)."""
        state = dict(state)
        for name in self.names:
            whole = model.get_parameter(name).detach().full_tensor()
            if name in state:
                state[name] = whole.to(state[name].device)
        return state


def _generate_in_step(model: nn.Module) -> None:
    """transformers' `generate` runs a forward per token until this rank's sequences end (EOS); a rank
    that ends first would leave its peers waiting in the experts' all-to-all (a hang). transformers'
    answer is `synced_gpus=True`, each rank stepping until every rank is done, which its generate
    turns on by itself for a model carrying `_is_fsdp_managed_module` (transformers' mark for
    "the ranks run forward together", FSDP's case and ep's): set here on every module of `model`
    that generates. A `synced_gpus=False` the script passes still wins."""
    for module in model.modules():
        if callable(getattr(module, "generate", None)):
            module._is_fsdp_managed_module = True


def _laid_out(param: torch.Tensor, layout: Layout, name: str, kind: str) -> tuple[Any, list[Any], torch.Tensor]:
    """(mesh, placements, this rank's tensor to take the experts from) of one expert weight: under tp,
    tensor parallel split it already (transformers' `packed_colwise` / `rowwise`, tp_experts.py), so each
    ep rank keeps its experts of the tp rank's part, on the 2-D mesh ep x tp; else the whole weight
    on the ep mesh."""
    if not isinstance(param, DTensor):
        return layout.mesh("ep"), [Shard(0)], param.detach()
    tp_split = [p for p in param.placements if hasattr(p, "dim")]  # Shard, or packed_colwise's _StridedShard
    if not tp_split or any(p.dim == 0 for p in tp_split):
        raise ValueError(
            f"ep={layout.plan.ep} ({layout.plan.describe()}) with tp: {kind}'s expert weight {name} is "
            f"{'replicated' if not tp_split else 'split on its experts dim'} by tensor parallel "
            f"({list(param.placements)}), so ep cannot split its experts over the ranks of each tp part. "
            "HINT: give tp_plan its experts 'packed_colwise' / 'rowwise' and the experts module "
            "'moe_tp_experts' (as transformers' own plans do), or use ep without tp"
        )
    return layout.mesh("ep_tp"), [Shard(0), *param.placements], param.to_local().detach()


def _refuse_compositions(model: nn.Module, layout: Layout) -> None:
    """ValueError for the layouts ep is not composed with yet (each with what runs instead)."""
    plan = layout.plan
    kind, where = type(model).__name__, plan.describe()
    if plan.tp > 1 and plan.pp > 1:
        raise ValueError(
            f"ep={plan.ep} ({where}) with tp and pp together: expert parallel is composed with tensor "
            f"parallel or with pipeline stages, not both yet, so {kind}'s experts cannot be laid out. "
            "HINT: use ep with tp (pp=1) or ep with pp (tp=1)"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"ep={plan.ep} ({where}): {kind} is on the meta device (built under px.init_module()), and "
            "expert parallel takes each rank's experts from the materialized weights. HINT: under ep, "
            "build the model outside px.init_module() (prepare keeps this rank's experts and frees the rest)"
        )
    if plan.shards_optimizer_only:
        raise ValueError(
            f"ep={plan.ep} ({where}): zero1 splits every parameter's optimizer state over the data-parallel "
            f"ranks as if each held the same ones, and under ep each holds other experts of {kind}. HINT: "
            "use strategy ddp, zero2 or zero3 with ep, or zero1 without ep"
        )


def after_tp(plan: ParallelPlan) -> bool:
    """Whether the experts are split after tensor parallel (ep x tp: each ep rank keeps its experts of
    its tp part) rather than before anything (the model whole)."""
    return plan.ep > 1 and plan.tp > 1


def apply(
    model: nn.Module,
    layout: Layout,
    device: torch.device,
    user_plan: Mapping[str, Any] | None = None,
    capacity_factor: float | None = None,
) -> ExpertParallel | None:
    """Split `model`'s experts over the layout's ep ranks, on `device` (before data parallel wraps the
    rest: DDP, or FSDP2 under zero2/zero3, both leaving the experts to this package); None when ep is 1
    (the model's own experts compute every token: a capacity factor drops nothing there)."""
    if layout.plan.ep == 1:
        return None
    return ExpertParallel(model, layout, device, user_plan, capacity_factor)


__all__ = ["ExpertParallel", "after_tp", "apply"]
