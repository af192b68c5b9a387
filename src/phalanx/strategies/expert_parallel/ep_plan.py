"""Which modules of a model are its experts, from the model's own expert-parallel plan.

transformers 5 declares one beside its tensor- and pipeline-parallel plans (`config.base_model_ep_plan`,
patterns under the base model, e.g. Qwen3-MoE's):
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm"    # a 3-D parameter [experts, ...]: split on dim 0
    "layers.*.mlp.experts.down_proj":    "grouped_gemm"
    "layers.*.mlp.experts": "ep_dispatch_experts"          # the module: tokens sent to their experts' ranks
A user `ep_plan` (the same shape, full module names or the base model's) takes its place. Every
refusal names the model, the numbers and the degrees that fit.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
import math
from typing import Any, Mapping

from torch import nn

from phalanx.strategies.plan.parallel_plan import ParallelPlan

PARAM_STYLE, MODULE_STYLE = "grouped_gemm", "ep_dispatch_experts"


@dataclass(frozen=True)
class ExpertsModule:
    """One MoE layer's experts: the module, its name, its 3-D parameters split on dim 0, the experts' count."""

    name: str
    module: nn.Module
    params: tuple[str, ...]
    num_experts: int


def _regex(pattern: str) -> re.Pattern[str]:
    """A plan pattern as a regex over full names: `*` one name part, any prefix optional (the base
    model's, or a wrapper's: peft's `base_model.model.model.`)."""
    parts = [r"[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")]
    return re.compile(r"^(?:.+\.)?" + r"\.".join(parts) + "$")


def model_plan(model: nn.Module, user_plan: Mapping[str, Any] | None) -> dict[str, str]:
    """The plan to apply: the user's (less its `capacity_factor`, an option: capacity.py), else the
    model's `config.base_model_ep_plan` (empty when none)."""
    patterns = {k: v for k, v in (user_plan or {}).items() if k != "capacity_factor"}
    if patterns:
        return patterns
    return dict(getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {})


def find(model: nn.Module, plan: Mapping[str, str], layout: ParallelPlan) -> list[ExpertsModule]:
    """Every experts module `plan` names, each checked splittable over the layout's ep ranks;
    ValueError (the numbers, the degrees that fit, HINT) when none is found or one cannot be split."""
    kind, ranks, where = type(model).__name__, layout.ep, layout.describe()
    unknown = sorted({style for style in plan.values() if style not in (PARAM_STYLE, MODULE_STYLE)})
    if unknown:
        raise ValueError(
            f"ep={ranks} ({where}): the expert-parallel plan of {kind} gives the style(s) {unknown}, which "
            f"phalanx does not apply. HINT: give ep_plan with {MODULE_STYLE!r} on each experts module and "
            f"{PARAM_STYLE!r} on its 3-D weights"
        )
    modules = [re_ for re_, style in ((_regex(p), s) for p, s in plan.items()) if style == MODULE_STYLE]
    params = [_regex(p) for p, s in plan.items() if s == PARAM_STYLE]
    found = []
    for name, module in model.named_modules():
        if not name or not any(r.match(name) for r in modules):
            continue
        _refuse_adapted(module, name, kind, ranks, where)
        _refuse_unrouted(module, name, kind, ranks, where)
        split = tuple(
            p for p, _ in module.named_parameters(recurse=False) if any(r.match(f"{name}.{p}") for r in params)
        )
        split = split or tuple(p for p, t in module.named_parameters(recurse=False) if t.dim() >= 2)
        counts = {module.get_parameter(p).shape[0] for p in split}
        if len(counts) != 1:
            raise ValueError(
                f"ep={ranks} ({where}): the experts module {name} of {kind} has no 3-D weights of one number "
                f"of experts to split (dim 0 of {list(split)}: {sorted(counts)}). HINT: give ep_plan naming "
                f"its [experts, ...] parameters {PARAM_STYLE!r}"
            )
        found.append(ExpertsModule(name, module, split, counts.pop()))
    if not found:
        for name, module in model.named_modules():  # experts of another kind (Llama4's): said as such
            if name.endswith("experts") and any(p.dim() == 3 for p in module.parameters(recurse=False)):
                _refuse_unrouted(module, name, kind, ranks, where)
        declared = (
            "its config declares no base_model_ep_plan"
            if not plan
            else f"no module matches its expert-parallel plan {dict(plan)}"
        )
        raise ValueError(
            f"ep={ranks} ({where}): {kind} has no mixture-of-experts layer to split ({declared}), so there "
            f"is nothing to put on the expert-parallel ranks. HINT: use ep=1 for a dense model (data "
            f"parallel alone), or give ep_plan {{'layers.*.mlp.experts': '{MODULE_STYLE}', ...}} naming its "
            "experts modules"
        )
    for experts in found:
        if experts.num_experts % ranks:
            both = math.gcd(experts.num_experts, layout.grad_size)
            fits = [d for d in range(2, both + 1) if both % d == 0]
            raise ValueError(
                f"ep={ranks} ({where}): {kind}'s MoE layers hold {experts.num_experts} experts each "
                f"({experts.name}), which {ranks} expert-parallel ranks cannot split evenly. HINT: choose ep "
                f"among {', '.join(map(str, fits)) or 'none'} (dividing both the {experts.num_experts} "
                f"experts and the {layout.grad_size} data-parallel x cp ranks), or ep=1"
            )
    return found


def _refuse_adapted(module: nn.Module, name: str, kind: str, ranks: int, where: str) -> None:
    """ValueError for experts whose fused weights peft adapted (LoRA `target_parameters`): its factors
    hold every expert's rows in one matrix (lora_A [r x experts, in]), which ep does not split."""
    if hasattr(module, "base_layer") and hasattr(module, "parameter_name"):
        raise ValueError(
            f"ep={ranks} ({where}): peft adapts the experts' fused weights of {name} in {kind} (LoRA "
            "target_parameters), and its factors hold every expert in one matrix (lora_A [r x experts, in]), "
            "which expert parallel does not split with the experts. HINT: under ep, give LoRA target_modules "
            "outside the experts (e.g. ['q_proj', 'v_proj']); for LoRA on the experts use ddp or zero3 without ep"
        )


def _refuse_unrouted(module: nn.Module, name: str, kind: str, ranks: int, where: str) -> None:
    """ValueError for an experts module whose forward does not take the routing (hidden_states,
    top_k_index, top_k_weights), which dispatch.py sends to the experts' ranks: Llama4's experts take
    every token once per expert, pre-scaled by its router score (`forward(hidden_states)`), and
    transformers declares no ep plan for them."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3:
        return
    raise ValueError(
        f"ep={ranks} ({where}): the experts module {name} of {kind} ({type(module).__name__}) takes "
        f"forward({', '.join(p.name for p in positional)}): every token once per expert, scaled by its router "
        "score, not the routing (hidden_states, top_k_index, top_k_weights) that expert parallel sends to "
        f"the experts' ranks, so {kind}'s experts cannot be split over ranks. HINT: use ep=1: zero3 (or "
        "zero2) shards its experts with every other weight, ddp keeps them whole on each rank"
    )
