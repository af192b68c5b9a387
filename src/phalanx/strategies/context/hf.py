"""transformers models under cp through their attention interface: phalanx registers its own
attention function (and a mask function that builds nothing: the mask comes from global positions
in the layout) and points the model's config at it. The model's code is unchanged.

The mask is rebuilt from what reaches the attention function: the layer's `is_causal` and
`sliding_window` (back only when causal, both ways when not: masks.py), the layout's padding, and
its documents where transformers reads them (a causal mask, no attention_mask given, a forward
without a cache: masking_utils skips packed documents when a cache is given). Layer kinds
whose mask or state this cannot rebuild (Llama4's chunked attention, linear/recurrent layers...)
are refused at prepare."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from phalanx.strategies.context import hf_arguments

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
        raise ValueError(
            f"context parallel: {type(model).__name__} does not take transformers' attention interface, "
            "so its attention cannot be sent across the cut. HINT: use a model whose attention goes "
            "through ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Qwen...), or run it with cp=1"
        )
    hf_arguments.check(model)  # an argument its attention takes that the cut would drop: refused here
    check_masks(model)
    model.set_attn_implementation(NAME)
    parameters = inspect.signature(model.forward).parameters.values()  # a PEFT wrapper passes **kwargs on
    if any(p.name == "position_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        model.register_forward_pre_hook(_global_positions, with_kwargs=True)


def _global_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """On a cut batch called without position_ids (a plain token tensor), the model's own
    0..S_local-1 would restart every chunk: give it this rank's tokens' places in the whole row.
    Also records whether this forward runs with a cache (the layout's `cached`)."""

    from phalanx.strategies.context.layout import active_layout, set_active

    layout = active_layout()
    if layout is None:
        return args, kwargs
    cached = _runs_with_cache(module, kwargs)
    if cached != layout.cached:  # attention drops the documents where transformers would
        set_active(dataclasses.replace(layout, cached=cached))
    if kwargs.get("position_ids") is None:
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        kwargs = {**kwargs, "position_ids": layout.local[None].to(device)}
    return args, kwargs


def _runs_with_cache(module: nn.Module, kwargs: dict) -> bool:
    """Whether this forward builds its mask with a cache, as transformers decides it: a cache passed, or
    use_cache (the argument, else the config's) unless gradient checkpointing turns it off in training
    (merge_with_config_defaults). With a cache, masking_utils reads no packed documents from position_ids."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return True
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(module, "config", None), "use_cache", None)
    checkpointed = (
        module.training
        and torch.is_grad_enabled()
        and any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())
    )
    return bool(use_cache) and not checkpointed


_REBUILT = ("full_attention", "sliding_attention")  # the layer kinds whose mask masks.py rebuilds


def check_masks(model: nn.Module) -> None:
    """ValueError when `model` has layers whose mask (or state) the cut attention cannot rebuild."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds and getattr(config, "attention_chunk_size", None):
        kinds = ["chunked_attention"]
    other = sorted({k for k in kinds if k not in _REBUILT})
    why = {"chunked_attention": "attends within chunks of attention_chunk_size tokens (Llama4-style)"}
    if other:
        said = "; ".join(f"{k}: {why.get(k, 'a mask or state phalanx does not rebuild')}" for k in other)
        raise ValueError(
            f"context parallel: {type(model).__name__} has layers of kind {', '.join(other)} ({said}), and the "
            "attention across the cut rebuilds only causal, bidirectional and sliding-window masks with packed "
            f"documents and padding, so those layers would attend differently from one process. HINT: run "
            f"{type(model).__name__} with cp=1, or use a model whose layer_types are {' / '.join(_REBUILT)}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"context parallel: {type(model).__name__} is an encoder-decoder model, whose cross-attention reads "
            "another sequence than the one cut. HINT: run it with cp=1"
        )


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from phalanx.strategies.context.cut_attention import attention
    from phalanx.strategies.context.layout import active_layout

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if active_layout() is None:  # no batch cut (an evaluation of whole rows): transformers' own sdpa
        if softcap is not None:  # which cannot soft-cap (Gemma2): the same explicit attention as the cut's
            return _whole_rows_softcapped(query, key, value, attention_mask, causal, sliding_window, scaling, softcap)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            sliding_window=sliding_window,
            **kwargs,
        )
    dropped = sorted(name for name in hf_arguments.KNOWN_UNAPPLIED if kwargs.get(name) is not None)
    if dropped:  # prepare reads the families' source; this catches an attention that got them another way
        raise ValueError(
            f"context parallel: {type(module).__name__} hands its attention {', '.join(dropped)}, which "
            "phalanx's attention across the cut does not apply. HINT: run this model with cp=1"
        )
    if dropout:
        raise ValueError(
            f"context parallel: attention dropout {dropout} in {type(module).__name__} is not supported "
            "across the cut. HINT: set the config's attention_dropout to 0 under cp"
        )
    layout = active_layout()
    if layout.documents is not None and (not causal or layout.attention_mask_given or layout.cached):
        # transformers reads packed documents from position_ids only for a causal mask with no attention_mask
        # and no cache (use_cache defaults to the config's True: one process then attends across documents)
        layout = dataclasses.replace(layout, documents=None)
    out = attention(
        query, key, value, causal=causal, sliding_window=sliding_window, scale=scaling, softcap=softcap, layout=layout
    )
    return out.transpose(1, 2).contiguous(), None


def _whole_rows_softcapped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    causal: bool,
    sliding_window: int | None,
    scaling: float | None,
    softcap: float,
) -> tuple[torch.Tensor, None]:
    """Soft-capped attention over whole rows with transformers' mask (None: plain causal, the queries
    the last keys, as in generation with a cache)."""
    from phalanx.strategies.context import masks
    from phalanx.strategies.context.cut_attention import attend_masked

    if attention_mask is None:
        keys = torch.arange(key.shape[2], device=query.device)
        attention_mask = masks.allowed(
            keys[key.shape[2] - query.shape[2] :], keys, causal=causal, sliding_window=sliding_window
        )
    elif attention_mask.dtype != torch.bool:  # an additive float mask: 0 where allowed
        attention_mask = attention_mask == 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend_masked(query, key, value, attention_mask, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> Any:
    """No mask for a cut batch (attention builds it from global positions); sdpa's for whole rows."""
    from phalanx.strategies.context.layout import active_layout

    if active_layout() is None:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, **kwargs)
    return None
