"""The chain of units of a transformers model, read from its own pipeline plan instead of traced.

transformers models declare their pipeline layout as they declare their tensor-parallel one:
`config.base_model_pp_plan` names the base model's modules in call order (`embed_tokens`, `layers`,
`norm`) and the head class's `_pp_plan` the head (`lm_head`). torch.fx cannot trace their forwards,
and need not: the forward calls exactly these modules one after another, each on the previous
one's output, with everything in between (position ids, the causal mask, rotary embeddings) computed
from the hidden state's shape alone. So the usual cut applies (chain.py, cut.py): the units another
stage owns become pass-throughs, and on a later stage the hidden state enters where the token ids
did (the embedding passes it on).

The model may sit inside a wrapper (peft's `PeftModelForCausalLM` -> `LoraModel` -> the model): the
units are named from the wrapper, so the stages of a LoRA model are cut from its base model's layers.

The forward returns a ModelOutput; the pipeline sends one tensor, so the stage returns its `logits`
(on every stage but the last, the hidden state the head's pass-through was handed: what the head's
forward does after the head layer, such as Gemma2's final logit softcapping, belongs to the last
stage), and runs without a key/value cache. The loss function and px.forward get the logits back in the model's output class.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from phalanx.strategies.pipeline.chain import ModelChain, Unit, find_chain
from phalanx.strategies.pipeline.cut import PassThrough

_LISTS = (nn.ModuleList, nn.Sequential)


def _declaring(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost module (and its name) that carries transformers' base_model_pp_plan."""
    for name, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_pp_plan", None)
        # the class's own prefix: peft's wrappers forward attribute reads to the model they hold
        if plan and isinstance(getattr(type(module), "base_model_prefix", None), str):
            return name, module
    return None


def has_plan(model: nn.Module) -> bool:
    """Whether `model` (or the model a wrapper holds) declares transformers' pipeline plan."""
    return _declaring(model) is not None


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def plan_chain(model: nn.Module) -> ModelChain:
    """The units of `model` in call order, from its declared pipeline plan; ValueError where the
    plan does not cover every parameter (those would train on no stage, or on every one)."""
    found = _declaring(model)
    assert found is not None  # noqa: S101 - has_plan was asked first
    outer, declaring = found
    join = lambda *parts: ".".join(p for p in parts if p)
    prefix = declaring.base_model_prefix
    base = join(outer, prefix) if isinstance(getattr(declaring, prefix, None), nn.Module) else outer
    units: list[Unit] = []
    blocks = ""
    for key in declaring.config.base_model_pp_plan:
        name = join(base, key)
        module = model.get_submodule(name)
        if isinstance(module, _LISTS):
            blocks = name
            units += [Unit(join(name, child), _count(sub), True) for child, sub in module.named_children()]
        else:
            units.append(Unit(name, _count(module), False))
    for key in getattr(type(declaring), "_pp_plan", None) or {}:  # the head's (instances add the base's)
        name = join(outer, key)
        units.append(Unit(name, _count(model.get_submodule(name)), False))
    covered = {id(p) for u in units for p in model.get_submodule(u.name).parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in covered]
    if outside:
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages from its base_model_pp_plan: "
            f"{', '.join(outside[:4])}{' ...' if len(outside) > 4 else ''} lie outside the modules the plan "
            "names, so no stage would own them. HINT: name the cut points with pp_split on a model whose "
            "forward is a plain chain of its modules, or train it without pp"
        )
    if not blocks:
        raise ValueError(
            f"cannot cut {type(model).__name__} into pipeline stages: its base_model_pp_plan names "
            "no list of layers to split between the stages"
        )
    return ModelChain(units=tuple(units), blocks=blocks)


class ModelOutputs:
    """The forward hook that hands the pipeline the output's `logits`, remembering the output's class
    (e.g. CausalLMOutputWithPast), so the loss function and px.forward receive the object one
    process's model returns (`out.logits` works in every layout). Stage views (deep copies of the
    model's skeleton) share this one hook: it holds no per-stage state. `head`: the name of the
    chain's last unit (the head layer)."""

    def __init__(self, head: str) -> None:
        self.output_type: type | None = None
        self.head = head

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not hasattr(output, "logits"):
            return output
        self.output_type = type(output)
        head = module.get_submodule(self.head)
        if isinstance(head, PassThrough):  # a stage before the last: the hidden state as the head got it
            return head.handed
        return output.logits

    def __deepcopy__(self, memo: dict[int, Any]) -> "ModelOutputs":
        return self

    def wrap(self, logits: Any) -> Any:
        """`logits` in the class the model returned (as it is once the forward ran on this rank)."""
        return logits if self.output_type is None else self.output_type(logits=logits)


def _no_cache(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    kwargs.setdefault("use_cache", False)
    return args, kwargs


def adapt_forward(model: nn.Module, chain: ModelChain) -> ModelOutputs:
    """Make `model`'s forward hand one tensor from stage to stage: its logits (the hidden state on
    the stages before the last), computed without a key/value cache; returns the hook that puts the
    last stage's logits back into the model's output class. `chain`: its units (`plan_chain`)."""
    outputs = ModelOutputs(chain.units[-1].name)
    model.register_forward_pre_hook(_no_cache, with_kwargs=True)
    model.register_forward_hook(outputs)
    return outputs


def model_chain(model: nn.Module) -> ModelChain:
    """The units a pipeline cuts `model` into: from its declared plan (transformers models), else
    found by tracing its forward (chain.py); a transformers model without a plan is refused with
    both reasons."""
    if has_plan(model):
        return plan_chain(model)
    try:
        return find_chain(model)
    except ValueError as error:
        if isinstance(getattr(model, "base_model_prefix", None), str) and hasattr(model, "config"):
            # the trace's own words (torch.fx's "co_varnames is too small"...) stay in the chained error
            raise ValueError(no_layout_message(model)) from error
        raise


def no_layout_message(model: nn.Module) -> str:
    """The refusal of a transformers model that declares no pipeline layout and is no plain chain."""
    name = type(model).__name__
    return (
        f"pp: {name} declares no pipeline layout (transformers' `base_model_pp_plan` in the model's config, "
        f"which phalanx cuts a transformers model's stages from; Llama-style decoders declare one, "
        f"{name} does not), and its forward is not a plain chain of its modules that phalanx could cut "
        "instead (it computes masks and other values between them), so the pp_split setting, which names "
        f"the modules to cut such a chain before, cannot cut it either. HINT: train {name} without pp "
        "(pp 1: a data-parallel strategy, or tp, or cp for long rows), or cut a model that declares "
        "base_model_pp_plan"
    )
