"""transformers models under cp through their attention interface: phalanx registers its own
attention function (and a mask function that builds nothing: the mask comes from global positions
in the layout) and points the model's config at it. The model's code is unchanged."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "phalanx_cp"


def is_transformers_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "_attn_implementation")


def route(model: nn.Module) -> None:
    """Make `model`'s attention layers call phalanx's cp attention; ValueError when it cannot."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"context parallel: {type(model).__name__} does not take transformers' attention interface, "
                         "so its attention cannot be sent across the cut. HINT: use a model whose attention goes "
                         "through ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen...), or run it with cp=1")
    model.set_attn_implementation(NAME)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
               sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from phalanx.strategies.context.cut_attention import attention
    from phalanx.strategies.context.layout import active_layout

    if active_layout() is None:  # no batch cut (an evaluation of whole rows): transformers' own sdpa
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, sliding_window=sliding_window, **kwargs)
    if dropout:
        raise ValueError(f"context parallel: attention dropout {dropout} in {type(module).__name__} is not supported "
                         "across the cut. HINT: set the config's attention_dropout to 0 under cp")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = attention(query, key, value, causal=causal, sliding_window=sliding_window, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> Any:
    """No mask for a cut batch (attention builds it from global positions); sdpa's for whole rows."""
    from phalanx.strategies.context.layout import active_layout

    if active_layout() is None:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, **kwargs)
    return None
