"""Tensor parallel on torch's `parallelize_module`: each layer named by a tensor-parallel plan is
split over the `tp` mesh dimension (ColwiseParallel, RowwiseParallel, SequenceParallel).

The plan for a model comes from, in order: the `tp_plan` setting, the model's own transformers
plan (`model._tp_plan` and `config.base_model_tp_plan`, the dicts transformers ships for Llama,
Qwen and friends), or a refusal naming the model class. A plan maps module-name patterns (`*`
matches one name segment: `layers.*.self_attn.q_proj`) to styles in transformers' vocabulary.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from torch import nn

from phalanx.config import names
from phalanx.model import memory
from phalanx.model.units import default_units
from phalanx.strategies import tied, tp_experts, tp_replicate
from phalanx.strategies.plan.parallel_plan import ParallelPlan

_NORMS = ("LayerNorm", "RMSNorm")  # class-name endings of the modules sequence parallel splits


def model_plan(model: nn.Module, given: Mapping[str, str] | None) -> dict[str, str]:
    """The tensor-parallel plan for `model`: `given` (the tp_plan setting), else the model's own
    transformers plan, else ValueError naming the class and how to give one."""
    if given:
        return dict(given)
    own = _transformers_plan(model)
    if own:
        return own
    raise ValueError(
        f"tp > 1, but {type(model).__name__} has no tensor-parallel plan: phalanx does not know which of its "
        "layers to split. HINT: give tp_plan={module name pattern: style}, e.g. "
        "{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': 'rowwise'} (Phalanx(tp_plan=...), YAML tp_plan:, "
        "or --tp-plan as JSON); transformers models with a base_model_tp_plan need none."
    )


def _transformers_plan(model: nn.Module) -> dict[str, str]:
    """transformers' plan: the base model's patterns under its prefix (`model.`), plus the head's."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for pattern, style in base.items():
        plan[f"{prefix}.{pattern}" if has_base else pattern] = style
    plan.update(getattr(model, "_tp_plan", None) or {})
    # a plan covers every variant of its family (Qwen3-MoE's dense-MLP layers): keep what this model has
    targets = _targets(model)
    return {
        k: names.TP_STYLE_ALIASES.get(v, v) for k, v in plan.items() if any(_pattern(k).match(name) for name in targets)
    }


def _targets(model: nn.Module) -> list[str]:
    """What a plan may name: modules, and parameters (transformers' 3-D expert weights)."""
    return [name for name, _ in model.named_modules() if name] + [name for name, _ in model.named_parameters()]


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(
        "^"
        + r"\.".join(".+" if part == "**" else "[^.]+" if part == "*" else re.escape(part) for part in text.split("."))
        + "$"
    )


def match(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Module name -> style for every module the plan names; ValueError for a pattern that matches
    none (a typo, or a plan for another model) or a style phalanx does not know."""
    modules = _targets(model)
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in names.TP_STYLES:
            raise ValueError(
                f"tp_plan {pattern!r}: unknown style {style!r}; choose one of {', '.join(names.TP_STYLES)}"
            )
        regex = _pattern(pattern)
        hits = [name for name in modules if regex.match(name)]
        if not hits:
            sample = ", ".join(modules[:8]) + (", ..." if len(modules) > 8 else "")
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(its modules: {sample}). HINT: write module names as named_modules() gives them, "
                "with * for one name segment (layers.*.attn.q)"
            )
        for name in hits:
            chosen[name] = style
    return chosen


def _style(style: str, sequence_parallel: bool) -> Any:
    """torch's ParallelStyle for a transformers style name (None: leave the module replicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1)
    if style == "colwise":
        return ColwiseParallel(input_layouts=seq) if sequence_parallel else ColwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
    if style == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate())
    if style == "embedding_rowwise":  # whole rows out: the model reads positions and masks from them
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "moe_tp_experts":
        return "experts"  # installed by tp_experts once its parameters are split
    return tp_replicate.replicate_style(style)  # None for local: left as it is


def apply(
    model: nn.Module,
    tp_mesh: Any,
    plan: Mapping[str, str] | None,
    sequence_parallel: bool = False,
    chosen: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Split the layers `plan` names over `tp_mesh`, in place; returns module name -> style applied.
    `chosen`: module name -> style, matched already (a pipeline stage's part of the whole model's plan).

    With `sequence_parallel`, activations between the split layers stay split along the sequence
    (dim 1): norms get SequenceParallel, and the first block splits its input by the sequence.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel, parallelize_module

    chosen = dict(chosen) if chosen is not None else match(model, model_plan(model, plan))
    ties = tied.tied_groups(model)
    chosen = tied.compatible_styles(model, chosen, ties)
    on_modules, on_params = tp_experts.split_entries(model, chosen)
    if on_params and sequence_parallel:
        raise ValueError(
            f"sequence_parallel with {type(model).__name__}'s expert parameters split by tp "
            f"({', '.join(sorted(set(on_params.values())))}): the experts take whole tokens. "
            "HINT: leave sequence_parallel off for this model"
        )
    tp_experts.apply_parameters(model, on_params, tp_mesh)
    styles = {name: _style(style, sequence_parallel) for name, style in on_modules.items()}
    if sequence_parallel:
        split = tuple(chosen)
        for name, module in model.named_modules():
            inside = any(name == s or name.startswith(s + ".") for s in split)
            if name and not inside and type(module).__name__.endswith(_NORMS):
                styles[name] = SequenceParallel()
        first = _first_block(model)
        styles[first] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    for name, style in styles.items():  # one module at a time: names are not patterns here
        if style == "experts":
            tp_experts.install_experts(model.get_submodule(name), tp_mesh)
        elif style is not None:
            parallelize_module(model.get_submodule(name), tp_mesh, style)
    tp_replicate.replicate_rest(model, tp_mesh, skip={n for n, s in chosen.items() if s == "local"})
    tied.retie(model, ties)
    return chosen


def _first_block(model: nn.Module) -> str:
    """The name of the first transformer block, where sequence parallel starts splitting the
    activations by the sequence. Not at the embedding's output: a transformers model reads its
    positions (rotary cos/sin) and its attention mask from the embedded sequence's length, which
    must stay whole; each block then gathers the sequence before attention and the MLP."""
    block = default_units(model)[0]
    return next(name for name, module in model.named_modules() if module is block)


def shrink_to_one_rank(model: nn.Module, tp_plan: Mapping[str, str] | None, plan: ParallelPlan) -> dict[str, str]:
    """Give a meta-device model the shapes one of `plan`'s tensor-parallel ranks holds (for `phalanx
    plan`): each split layer's weight narrowed to its 1/tp part, outputs that tensor parallel gathers
    (and inputs it splits) kept at their full sizes, so a meta forward sees what one rank computes and
    saves. Returns module name -> style (`tp_plan`: the tp_plan setting), as `apply` would."""
    tp = plan.tp
    chosen = match(model, model_plan(model, tp_plan))
    modules = dict(model.named_modules())
    for name, style in chosen.items():
        if name not in modules:  # a parameter the plan names (an MoE's 3-D expert weights)
            owner, _, pname = name.rpartition(".")
            param = getattr(modules[owner], pname)
            _narrow(modules[owner], pname, param.dim() - (1 if style == "rowwise" else 2), tp)
            continue
        module = modules[name]
        weight = getattr(module, "weight", None)
        if style in ("replicate", "replicated_with_grad_allreduce", "local", "sequence_parallel") or weight is None:
            continue
        if isinstance(module, nn.Embedding) or style == "embedding_rowwise":
            dim, full_out = 0, None
        elif style in ("colwise", "colwise_gather_output"):
            dim, full_out = 0, weight.shape[0] if style == "colwise_gather_output" else None
        else:  # rowwise, rowwise_split_input
            dim, full_out = 1, None
        if weight.shape[dim] % tp:
            raise ValueError(
                f"tp={tp}: layer {name!r} ({type(module).__name__}) has {weight.shape[dim]} "
                f"{'rows' if dim == 0 else 'columns'} to split, not a multiple of {tp}. "
                f"HINT: choose tp among the divisors of {weight.shape[dim]}"
            )
        whole = tuple(weight.shape)
        _narrow(module, "weight", dim, tp)
        if isinstance(module, nn.Embedding):  # torch's embedding backward gives its gradient whole
            setattr(module.weight, memory.GRAD_SHAPE_ATTR, whole)
        if dim == 0 and getattr(module, "bias", None) is not None:
            _narrow(module, "bias", 0, tp)
        if full_out is not None:
            module.register_forward_hook(lambda m, a, out, n=full_out: out.new_empty(*out.shape[:-1], n))
        if style == "rowwise_split_input":
            module.register_forward_pre_hook(lambda m, args: (args[0][..., : args[0].shape[-1] // tp], *args[1:]))
    return chosen


def _narrow(module: nn.Module, name: str, dim: int, parts: int) -> None:
    """Replace `module.name` by an empty (meta) parameter 1/parts the size along `dim`."""
    old = getattr(module, name)
    shape = list(old.shape)
    shape[dim] //= parts
    setattr(module, name, nn.Parameter(old.new_empty(shape), requires_grad=old.requires_grad))
