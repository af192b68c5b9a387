"""Whether a tensor-parallel degree fits a model, checked at prepare before anything is split.

Each tensor-parallel rank must hold whole attention heads and key/value heads and an equal part of
every layer the plan splits. torch splits a weight that tp does not divide into unequal parts
without a word, and a model that views its projections as heads (`view(..., -1, head_dim)`) then
fails in its first forward, far from the cause: a Llama with 2 key/value heads at tp 4 has
k_proj rows that 4 divides, but half a head per rank.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from torch import nn

from phalanx.strategies.plan.parallel_plan import ParallelPlan

# transformers' config fields that tensor parallel splits: the name a message uses for each
_CONFIG_FIELDS = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP width"),
)
# Styles that leave a layer whole, or whose uneven split torch handles end to end (an embedding's
# rows, a head whose output is gathered: a vocabulary of 50257 at tp 2 is fine).
_NOT_CHECKED = ("replicate", "local", "sequence_parallel", "embedding_rowwise", "colwise_gather_output")


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def split_sizes(model: nn.Module, chosen: Mapping[str, str]) -> list[tuple[str, int]]:
    """(what, size) of everything tensor parallel splits evenly: the config's heads and MLP width,
    and each planned linear layer's split dimension (rows for colwise, columns for rowwise)."""
    sizes: list[tuple[str, int]] = []
    config = _config(model)
    for field, what in _CONFIG_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            sizes.append((f"{what} ({field}={value})", value))
    modules = dict(model.named_modules())
    for name, style in chosen.items():
        weight = getattr(modules.get(name), "weight", None)
        if style in _NOT_CHECKED or weight is None or weight.dim() < 2 or isinstance(modules[name], nn.Embedding):
            continue
        dim = 1 if style.startswith("rowwise") else 0
        sizes.append((f"layer {name!r} ({weight.shape[dim]} {'columns' if dim else 'rows'})", weight.shape[dim]))
    return sizes


def check(model: nn.Module, plan: ParallelPlan, chosen: Mapping[str, str]) -> None:
    """ValueError naming every size the plan's tp does not divide, and the degrees that would fit."""
    tp = plan.tp
    sizes = split_sizes(model, chosen)
    bad = [what for what, size in sizes if size % tp]
    if not bad:
        return
    common = math.gcd(*(size for _, size in sizes))
    fits = [d for d in range(1, common + 1) if common % d == 0 and d <= max(tp, 8)]
    raise ValueError(
        f"tp={tp} does not divide the model's {', '.join(bad)}: each tensor-parallel rank must hold whole heads and "
        f"an equal part of every split layer. HINT: choose tp among {', '.join(map(str, fits))}"
    )
