"""Attention across the cut, two ways, chosen by the key/value heads:

- Ulysses: an all-to-all swaps the sequence split for a head split, every rank attends over the
  whole sequence for heads / cp heads, and a second all-to-all swaps back. Needs the key/value
  heads divisible by cp; moves q, k, v and the output once each.
- all-gather: every rank gathers the whole sequence's keys and values and attends with its own
  queries; any head count. The backward reduce-scatters the key/value gradients.

Both apply the mask from global positions (masks.py), so the result equals one process's.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F

from phalanx.strategies.context import comm, masks, sdpa_pause
from phalanx.strategies.context.layout import SequenceLayout, active_layout


class Algorithm(str, enum.Enum):
    ULYSSES = "ulysses"
    ALLGATHER = "allgather"


ALGORITHMS = ("auto", *(a.value for a in Algorithm))
last_used: dict = {}  # what the last call across a cut ran: algorithm, why, and the calls so far


def choose_algorithm(num_kv_heads: int, cp_size: int, requested: str = "auto") -> tuple[Algorithm, str]:
    """The algorithm for `num_kv_heads` key/value heads over `cp_size` ranks, and why."""
    if requested not in ALGORITHMS:
        raise ValueError(f"context parallel: unknown attention algorithm {requested!r}; valid: {', '.join(ALGORITHMS)}")
    divisible = num_kv_heads % cp_size == 0
    if requested == Algorithm.ULYSSES.value and not divisible:
        raise ValueError(
            f"context parallel: Ulysses splits the {num_kv_heads} key/value heads over cp={cp_size} "
            "ranks, which does not divide them. HINT: use algorithm 'allgather' (any head count) or 'auto'"
        )
    if requested != "auto":
        return Algorithm(requested), "requested"
    if divisible:
        return Algorithm.ULYSSES, f"{num_kv_heads} key/value heads divide over cp={cp_size}"
    return Algorithm.ALLGATHER, f"{num_kv_heads} key/value heads do not divide over cp={cp_size}"


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    algorithm: str = "auto",
    layout: SequenceLayout | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of this rank's queries [B, H, S_local, D] over the whole
    sequence, keys/values [B, H_kv, S_local, D] (H a multiple of H_kv); returns [B, H, S_local, D].

    `layout` (default: the batch cut by shard_sequence) says where these tokens sit in the whole
    sequence and carries the packed-document and padding masks; without one, the tokens are the
    whole sequence. Queries that may attend to no key (padding before any real token) give zeros.
    `softcap` (Gemma2's attn_logit_softcapping): scores become softcap * tanh(scores / softcap).
    """
    layout = layout if layout is not None else active_layout()
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    mask_of = dict(
        causal=causal,
        sliding_window=sliding_window,
        documents=None if layout is None else layout.documents,
        key_padding=None if layout is None else layout.key_padding,
    )
    if layout is None or layout.cp_size == 1:
        return _attend_whole(query, key, value, mask_of, scale, softcap)
    chosen, why = choose_algorithm(key.shape[1], layout.cp_size, algorithm)
    last_used.update(algorithm=chosen.value, why=why, calls=last_used.get("calls", 0) + 1)
    gathered = layout.gathered.to(query.device)
    if chosen is Algorithm.ULYSSES:
        # whole sequences for heads / cp heads, put back in their natural order: a plain causal mask
        # then needs no mask tensor (SDPA's own is_causal, memory linear in the sequence)
        order = gathered.argsort()
        q, k, v = (comm.heads_to_sequence(t, layout.group).index_select(2, order) for t in (query, key, value))
        out = _attend_whole(q, k, v, mask_of, scale, softcap)
        return comm.sequence_to_heads(out.index_select(2, gathered), layout.group)
    k, v = (comm.gather_sequence(t, 2, layout.group) for t in (key, value))
    return attend_masked(query, k, v, masks.allowed(layout.local.to(query.device), gathered, **mask_of), scale, softcap)


def _attend_whole(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_of: dict, scale: float, softcap: float | None
) -> torch.Tensor:
    """Attention over whole sequences in natural order: SDPA's is_causal when the mask is only causal."""
    if softcap is None and all(mask_of[name] is None for name in ("sliding_window", "documents", "key_padding")):
        with sdpa_pause.paused():
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=mask_of["causal"], scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
    positions = torch.arange(q.shape[2], device=q.device)
    return attend_masked(q, k, v, masks.allowed(positions, positions, **mask_of), scale, softcap)


def attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Attention of q [B, H, Sq, D] over k, v [B, H_kv, Sk, D] where the bool `mask` allows;
    soft-capped scores (SDPA has no softcap) computed explicitly, as transformers' eager attention."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    anything = mask.any(-1, keepdim=True)  # a row that may see nothing would be NaN: give it zeros
    if softcap is None:
        with sdpa_pause.paused():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~anything, scale=scale)
    else:
        scores = torch.tanh(q @ k.transpose(-2, -1) * (scale / softcap)) * softcap
        scores = scores.masked_fill(~(mask | ~anything), float("-inf"))
        out = scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v
    return out * anything if not bool(anything.all()) else out
