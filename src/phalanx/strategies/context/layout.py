"""Which tokens of a sequence this rank of a cp group holds, and the mask the batch carries.

The load-balanced cut: the sequence is cut into 2 x cp equal chunks and rank i holds chunks i and
2cp-1-i, so under a causal mask every rank has the same number of (query, key) pairs to compute.
Positions stay global: every index here is a token's place in the whole sequence.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


def local_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions rank `cp_rank` of `cp_size` holds, in the order it holds them."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallel: a sequence of {seq_len} tokens does not cut into 2 x cp = "
            f"{2 * cp_size} equal chunks. HINT: make the sequence length a multiple of "
            f"{2 * cp_size}, or pass pad=True to shard_sequence (padding is masked and its "
            "targets ignored)"
        )
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


@dataclass(frozen=True)
class SequenceLayout:
    """One batch's cut: the cp group, the global positions held here and in gathered order, and the
    masks the whole sequence carries (document ids of packed rows, padding)."""

    cp_size: int
    cp_rank: int
    group: Any  # the cp ranks' process group (None: one process, or every rank)
    seq_len: int
    documents: torch.Tensor | None = None
    """[batch, seq_len] document id of every token of packed rows (position_ids restarting); None: one per row."""
    key_padding: torch.Tensor | None = None
    """[batch, seq_len] True for real tokens (attention_mask); None: no padding."""
    attention_mask_given: bool = False
    """the inputs carried an attention_mask (transformers then reads no documents from position_ids)."""
    cached: bool = False
    """the forward runs with a cache (use_cache; transformers then reads no documents from position_ids either)."""

    @property
    def local(self) -> torch.Tensor:
        """The global positions of this rank's tokens, in local order."""
        return local_indices(self.seq_len, self.cp_size, self.cp_rank)

    @property
    def gathered(self) -> torch.Tensor:
        """The global positions of the whole sequence in the order the cp ranks' parts are gathered."""
        return torch.cat([local_indices(self.seq_len, self.cp_size, r) for r in range(self.cp_size)])


_active: list[SequenceLayout] = []


def active_layout() -> SequenceLayout | None:
    """The layout of the batch in flight (set by shard_sequence or `using_layout`); None: no cut."""
    return _active[-1] if _active else None


def local_padding() -> torch.Tensor | None:
    """[batch, this rank's tokens] True for real ones, in local order, of the batch in flight; None
    when it has no padding (or no batch is cut). The model sees no attention_mask under the cut."""
    layout = active_layout()
    if layout is None or layout.key_padding is None:
        return None
    return layout.key_padding[:, layout.local.to(layout.key_padding.device)]


def set_active(layout: SequenceLayout | None) -> None:
    """Make `layout` the one attention reads until the next batch is cut."""
    _active.clear()
    if layout is not None:
        _active.append(layout)


@contextlib.contextmanager
def using_layout(layout: SequenceLayout | None) -> Iterator[None]:
    """Attention inside the block reads `layout`; the previous one is back after it."""
    saved = list(_active)
    set_active(layout)
    try:
        yield
    finally:
        _active[:] = saved
