"""Which arguments a transformers family hands its attention function, read from its attention
layers' source at prepare: each one phalanx's attention across the cut applies is listed in
APPLIED; any other (GPT-OSS's sinks `s_aux`, T5's `position_bias`, a sparse attention's `indices`)
would be dropped on cut batches, silently changing the model, so cp is refused for that model."""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

# what the cut's attention applies: the mask comes from global positions in the layout (causal,
# packed documents from position_ids, padding from attention_mask), the rest in cut_attention.py
APPLIED = frozenset({"attention_mask", "dropout", "scaling", "is_causal", "sliding_window", "softcap", "position_ids"})
# arguments that do not change the result: flash-attention's determinism flag (ModernBERT)
NO_EFFECT = frozenset({"deterministic"})
# arguments transformers families hand their attention that change its result and the cut does not
# apply (sinks, relative position biases, sparse attention's indices)
KNOWN_UNAPPLIED = ("s_aux", "sinks", "position_bias", "indices")


def unapplied_arguments(model: nn.Module) -> dict[str, str]:
    """{argument: the attention layer class handing it} for every keyword argument `model`'s
    attention layers pass to transformers' attention function that the cut does not apply."""
    found: dict[str, str] = {}
    for cls in {type(module) for module in model.modules()}:
        for name in _attention_call_keywords(cls):
            if name not in APPLIED | NO_EFFECT:
                found.setdefault(name, cls.__name__)
    return found


def check(model: nn.Module) -> None:
    """ValueError naming the model and each argument its attention takes that the cut would drop."""
    unapplied = unapplied_arguments(model)
    if unapplied:
        named = ", ".join(f"{arg!r} (from {layer})" for arg, layer in sorted(unapplied.items()))
        raise ValueError(
            f"context parallel: {type(model).__name__} hands its attention {named}, which phalanx's "
            "attention across the cut does not apply: cut batches would train another model. HINT: "
            f"run {type(model).__name__} with cp=1 (ddp, zero2/zero3 or tp), or use a family whose "
            f"attention takes only {', '.join(sorted(APPLIED - {'attention_mask', 'position_ids'}))}"
        )


def _attention_call_keywords(cls: type) -> set[str]:
    """Keyword names of `attention_interface(...)` calls in `cls.forward` (none when it has no source)."""
    forward = cls.__dict__.get("forward")
    if forward is None:
        return set()
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):  # no source (a C extension, a generated class): nothing transformers routes
        return set()
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
            names.update(k.arg for k in node.keywords if k.arg is not None)
    return names
