"""Tensor parallel through a PEFT (LoRA) wrapper: the base model's plan, under the wrapper's names,
with each adapter laid out to match the layer it adapts.

`get_peft_model` nests the transformers model (`base_model.model.`) and replaces each adapted Linear
with a LoRA layer holding the original as `base_layer` beside `lora_A` (in -> r) and `lora_B`
(r -> out). The base model's patterns, prefixed, name those LoRA layers; each is split as:
- colwise (q/k/v, gate/up): `base_layer` colwise, `lora_B` colwise, `lora_A` whole on every rank:
  each rank computes its own rows of both terms from the whole input;
- rowwise (o, down): `base_layer` rowwise, `lora_A` rowwise (its input is the rank's part of the
  activations; the r-wide result is all-reduced), `lora_B` whole: both terms come out whole.
The sum `base_layer(x) + scaling * lora_B(lora_A(x))` is then what one process computes.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from phalanx.strategies import tensor_parallel

_ADAPTED = {"colwise": "lora_B", "rowwise": "lora_A"}  # which adapter matrix follows the base layer's split


def is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def _prefix(model: nn.Module, inner: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is inner:
            return f"{name}." if name else ""
    raise ValueError(f"the PEFT model's base model is not among its modules ({type(inner).__name__})")


def choose(model: nn.Module, given: Mapping[str, str] | None) -> dict[str, str]:
    """Module name -> style for `model` (plain, or a PEFT model: the base model's plan or `given`,
    matched under the wrapper's names, with the LoRA layers expanded as above)."""
    if not is_peft(model):
        return tensor_parallel.match(model, tensor_parallel.model_plan(model, given))
    base = model.get_base_model()
    prefix = _prefix(model, base)
    plan = {f"{prefix}{pattern}": style for pattern, style in tensor_parallel.model_plan(base, given).items()}
    chosen = tensor_parallel.match(model, plan)
    modules = dict(model.named_modules())
    expanded: dict[str, str] = {}
    for name, style in chosen.items():
        module = modules[name]
        if not isinstance(getattr(module, "base_layer", None), nn.Module):
            expanded[name] = style
            continue
        if style not in _ADAPTED:
            raise ValueError(
                f"tp_plan style {style!r} on the LoRA-adapted layer {name!r}: adapters follow colwise or "
                "rowwise layers only. HINT: leave that layer out of target_modules, or split it colwise "
                "or rowwise"
            )
        expanded[f"{name}.base_layer"] = style
        adapters: Any = getattr(module, _ADAPTED[style], {})
        for adapter in adapters:
            expanded[f"{name}.{_ADAPTED[style]}.{adapter}"] = style
    return expanded
