"""`F.scaled_dot_product_attention` routed across the cut: a model that keeps torch's attention
call runs unchanged under cp, its calls sent to phalanx's attention while the mode is on."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from phalanx.strategies.context import cut_attention, sdpa_pause


class RouteAttention(TorchFunctionMode):
    """Sends F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...) to cp attention."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or sdpa_pause.is_paused():
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = {**dict(zip(names, args)), **kwargs}
        if call.get("attn_mask") is not None:
            raise ValueError(
                "context parallel: F.scaled_dot_product_attention was called with attn_mask, which "
                "is local to this rank's part of the sequence. HINT: pass is_causal=True and give the "
                "masks in the inputs (position_ids for packed documents, attention_mask for padding): "
                "phalanx builds the mask from global positions"
            )
        if call.get("dropout_p", 0.0):
            raise ValueError(
                "context parallel: attention dropout is not supported across the cut. HINT: set "
                "dropout_p=0 (the attention dropout of the model's config) under cp"
            )
        return cut_attention.attention(
            call["query"],
            call["key"],
            call["value"],
            causal=bool(call.get("is_causal", False)),
            scale=call.get("scale"),
        )


def routed() -> contextlib.AbstractContextManager[Any]:
    """A block inside which SDPA calls go across the cut."""
    return RouteAttention()
