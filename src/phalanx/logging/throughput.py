"""Throughput for the progress bar, the metrics files and the trackers: samples/s, tokens/s, MFU.

A prepared loader hands each batch to `count_batch` (its samples, and its tokens when it holds
token ids: a mapping with `input_ids`, non-padding ones by its `attention_mask`, or a 2-D integer
tensor first in a tuple); `px.backward` commits the last batch's counts, so evaluation batches are
not counted. Rates are over the wall time since the last `px.log` row, for the whole job: this
rank's counts times the data-parallel size (ranks take batches of one size; no collective is spent on
it), from the arrival of the first batch trained on after the previous row. A row that logs `tokens` (the job's count since the previous row) gives the exact figure.
MFU: the model FLOPs this rank ran (model/flops.py) per second over its device's peak
(runtime/device_peaks.py), only when both are known.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable

import torch

SAMPLES, TOKENS, MFU = "samples_per_s", "tokens_per_s", "mfu"
TOKENS_LOGGED = "tokens"  # a px.log key: tokens processed by the job since the previous row


def batch_counts(batch: Any) -> tuple[int | None, int | None, int | None]:
    """(samples, tokens, sequence length) of a batch; None where the batch does not say."""
    ids, mask = None, None
    if isinstance(batch, Mapping) or (hasattr(batch, "keys") and hasattr(batch, "__getitem__")):
        if "input_ids" in batch.keys():
            ids, mask = batch["input_ids"], batch["attention_mask"] if "attention_mask" in batch.keys() else None
        first = next((batch[k] for k in batch.keys() if isinstance(batch[k], torch.Tensor)), None)
    else:
        first = (
            batch
            if isinstance(batch, torch.Tensor)
            else next((v for v in batch if isinstance(v, torch.Tensor)), None)
            if isinstance(batch, (list, tuple))
            else None
        )
        if first is not None and first.dim() == 2 and not first.is_floating_point() and not first.is_complex():
            ids = first
    samples = int(first.shape[0]) if first is not None and first.dim() > 0 else None
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return samples, None, None
    tokens = int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel()
    return samples, tokens, int(ids.shape[-1])


class Throughput:
    def __init__(self, world_size: int = 1, clock: Callable[[], float] = time.monotonic):
        self.world_size = world_size
        self.clock = clock
        self.flops_per_token: Callable[[int], float] | None = None  # (sequence length) -> FLOPs
        self.peak: float | None = None  # FLOP/s of this rank's device
        self.share = 1.0
        self._pending: tuple[tuple[int | None, int | None, int | None], float] | None = None
        self._start: float | None = None  # the first trained batch's arrival since the last snapshot
        self._samples = 0
        self._tokens = 0
        self._flops = 0.0
        self._has_tokens = False

    def set_model(self, flops_per_token: Callable[[int], float] | None, peak: float | None, share: float = 1.0) -> None:
        """`share`: the part of each token's FLOPs this rank runs (1 / the tensor-parallel degree)."""
        self.flops_per_token, self.peak, self.share = flops_per_token, peak, share

    def count_batch(self, batch: Any) -> None:
        """A prepared loader yields `batch`: counted once a backward uses it."""
        self._pending = (batch_counts(batch), self.clock())

    def on_backward(self, loss: Any, num_items: Any) -> None:
        """The loop's callback (loop/callbacks.py): px.backward trains on the latest batch."""
        self.commit()

    def commit(self) -> None:
        """px.backward: the latest batch was trained on."""
        if self._pending is None:
            return
        (samples, tokens, seq_len), arrived = self._pending
        self._pending = None
        if self._start is None:
            self._start = arrived
        self._samples += samples or 0
        if tokens is not None:
            self._has_tokens = True
            self._tokens += tokens
            if self.flops_per_token is not None and seq_len:
                self._flops += tokens * self.flops_per_token(seq_len) * self.share

    def current(self, logged_tokens: float | None = None) -> dict[str, float]:
        """Rates since the last `snapshot` (nothing when no batch was trained on)."""
        if self._start is None:
            return {}
        elapsed = self.clock() - self._start
        if elapsed <= 0:
            return {}
        rates: dict[str, float] = {}
        if self._samples:
            rates[SAMPLES] = self._samples * self.world_size / elapsed
        if logged_tokens is not None:
            rates[TOKENS] = float(logged_tokens) / elapsed
        elif self._has_tokens:
            rates[TOKENS] = self._tokens * self.world_size / elapsed
        if self._flops and self.peak:
            rates[MFU] = self._flops / elapsed / self.peak
        return rates

    def snapshot(self, logged_tokens: float | None = None) -> dict[str, float]:
        """The rates since the previous snapshot (a px.log row), then start a new interval."""
        rates = self.current(logged_tokens)
        self._start = None
        self._samples, self._tokens, self._flops, self._has_tokens = 0, 0, 0.0, False
        return rates
