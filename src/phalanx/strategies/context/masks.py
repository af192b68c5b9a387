"""The (query, key) pairs a batch allows, from global positions: causal, packed documents
(block-diagonal), a sliding window (back only when causal, Mistral; both ways when not, ModernBERT),
padding. The same function serves one process and every rank of a cp group, so a cut can never
change the mask."""

from __future__ import annotations

import torch


def allowed(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    documents: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [batch or 1, 1, len(queries), len(keys)]: True where the query at global position
    queries[i] may attend to the key at keys[j]."""
    q, k = queries[:, None], keys[None, :]
    mask = torch.ones(len(queries), len(keys), dtype=torch.bool, device=queries.device)
    if causal:
        mask &= k <= q
    if sliding_window is not None:
        # transformers' overlays, given the sliding_window its attention layers pass: causal (Mistral)
        # kv_idx > q_idx - sliding_window; bidirectional, both ways: ModernBERT passes local_attention
        # // 2 + 1 for |q - k| <= local_attention // 2, Gemma3's bidirectional window |q - k| < sliding_window
        mask &= (q - k < sliding_window) if causal else ((q - k).abs() < sliding_window)
    mask = mask[None]
    if documents is not None:
        mask = mask & (documents[:, queries, None] == documents[:, None, keys])
    if key_padding is not None:
        mask = mask & key_padding[:, None, keys]
    return mask[:, None]


def documents_of(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq] document ids of packed rows: a new document wherever a position does not follow
    the previous one by 1 (transformers' rule); None when every row is one document."""
    first = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs
