"""transformers' mixture-of-experts tensor-parallel styles (Mixtral, Qwen3-MoE: `base_model_tp_plan`).

Their experts hold every expert's weights fused in 3-D parameters, and the plan names those
parameters, not modules:
- `experts.gate_up_proj` [experts, 2*intermediate, hidden] `packed_colwise`: the gate half and the
  up half are each split by rows, so a rank holds gate part r followed by up part r and its local
  `chunk(2)` still pairs them (`_StridedShard(1, split_factor=2)`, as transformers lays it out);
- `experts.down_proj` [experts, hidden, intermediate] `rowwise` (or any parameter `colwise`/`rowwise`):
  the last (rowwise) or second-last (colwise) dimension split, `Shard()`;
- `experts` `moe_tp_experts`: the module runs on each rank's parts as plain tensors. Its inputs
  (the tokens, the routing weights) are whole on every rank, so their gradients are summed over
  the ranks in backward; its output is each rank's partial sum over the intermediate features,
  summed over the ranks in forward (transformers' `MoeExpertsParallel`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch import nn

PARAM_STYLES = ("packed_colwise", "colwise", "rowwise")  # styles a plan may give a parameter


def _sum_over(group: Any, forward: bool) -> Any:
    """autograd function: all-reduce (sum) over `group` in forward (identity backward), or in backward."""

    class _Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            if not forward:
                return x.view_as(x)
            x = x.contiguous().clone()
            torch.distributed.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if forward:
                return grad
            grad = grad.contiguous().clone()
            torch.distributed.all_reduce(grad, group=group)
            return grad

    return _Sum.apply


def shard_parameter(module: nn.Module, pname: str, style: str, mesh: Any) -> None:
    """Replace `module.pname` by its DTensor split over `mesh` as `style` says."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    param = module._parameters[pname]
    if style == "packed_colwise":
        placement = _StridedShard(param.dim() - 2, split_factor=2) if param.dim() > 1 else Shard(0)
    elif style == "colwise":
        placement = Shard(max(param.dim() - 2, 0))
    else:  # rowwise
        placement = Shard(param.dim() - 1)
    dt = distribute_tensor(param.data, mesh, [placement])
    module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local parts for one forward (differentiable: the
    local part's gradient becomes the DTensor's)."""
    from torch.distributed.tensor import DTensor

    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._parameters.update({n: p.to_local() for n, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)


def install_experts(module: nn.Module, mesh: Any) -> None:
    """`moe_tp_experts`: forward on the local parts, partial outputs summed over the tp ranks."""
    from torch.distributed.tensor import DTensor

    whole = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
    if whole:  # its output would be every rank's whole result summed: tp times too large
        raise ValueError(
            f"tp_plan: 'moe_tp_experts' on {type(module).__name__}, but its parameters {whole} are not "
            "split by the plan. HINT: give them 'packed_colwise' / 'rowwise' entries (as transformers' "
            "own plan does), or use strategy='zero3' instead of tp for this model"
        )
    group = mesh.get_group()
    whole_in, partial_out = _sum_over(group, forward=False), _sum_over(group, forward=True)
    inner = module.forward

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        with _local_parameters(module):
            out = inner(whole_in(hidden_states), top_k_index, whole_in(top_k_weights), *args, **kwargs)
        return partial_out(out)

    module.forward = forward


def split_entries(model: nn.Module, chosen: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(module entries, parameter entries) of `chosen`; ValueError for a style on the wrong kind."""
    modules = dict(model.named_modules())
    on_modules, on_params = {}, {}
    for name, style in chosen.items():
        if name in modules:
            if style == "packed_colwise":
                raise ValueError(
                    f"tp_plan: {type(model).__name__} gives the module {name!r} the style 'packed_colwise'; phalanx "
                    "splits packed weights only where the plan names the 3-D expert parameter itself. HINT: use "
                    "strategy='zero3' or pp instead of tp for this model, or give tp_plan with that layer 'replicate'"
                )
            on_modules[name] = style
        else:
            if style not in PARAM_STYLES:
                raise ValueError(
                    f"tp_plan: style {style!r} on the parameter {name!r} of {type(model).__name__}: "
                    f"a parameter takes {', '.join(PARAM_STYLES)}. HINT: name its module instead"
                )
            on_params[name] = style
    return on_modules, on_params


def apply_parameters(model: nn.Module, on_params: Mapping[str, str], mesh: Any) -> None:
    """Split every parameter entry over `mesh`."""
    for name, style in on_params.items():
        owner, _, pname = name.rpartition(".")
        shard_parameter(model.get_submodule(owner), pname, style, mesh)
