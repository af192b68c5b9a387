"""Inside the workers of `phalanx parity`: record each optimizer step's loss and gradient norm.

`phalanx parity` runs an unmodified script twice (one process, then N) with PHALANX_PARITY_RECORD
set. Then `Phalanx()` builds a `ParityRecorder`, which: takes dropout out (torch's functional dropout
becomes the identity, so nn.Dropout and F.dropout alike draw no random numbers); multiplies each
prepared loader's batch by PHALANX_PARITY_BATCH_SCALE (the one-process run takes the global batch);
collects the loss of every `px.backward`; and before each optimizer step (after num_items' rescale,
before clipping) writes one JSON line on rank 0: the step as `px.global_step` will count it, the
global loss, the global gradient norm, each rank's own loss, and what the comparison may need to
explain a difference (BatchNorm layers not synced, loaders not prepared, per-rank seeds). After
PHALANX_PARITY_STEPS steps every rank leaves at once: `ParityStop`, a SystemExit(0).
"""

from __future__ import annotations

import atexit
import hashlib
import json
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.model.sync_batchnorm import unsynced_batchnorms
from phalanx.runtime import collectives
from phalanx.runtime.context import ParityRequest

_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


class ParityStop(SystemExit):
    """Ends the script after the last step asked for: a clean exit (code 0) on every rank."""


class ParityRecorder:
    def __init__(self, path: str, steps: int, batch_scale: int, rank: int, world_size: int):
        self.path, self.steps, self.batch_scale = path, steps, batch_scale
        self.rank, self.world_size = rank, world_size
        self.loss_sum = 0.0
        self.items_sum = 0.0
        self.num_backward = 0  # since the last step
        self.total_backward = 0
        self.num_recorded = 0
        self.rng_digest: str | None = None  # torch's RNG state at the first backward
        self.unsynced: list[str] = []
        self.dropout_layers = 0
        self.prepared_loaders = 0
        self.batch_size: int | None = None  # this rank's first prepared loader's batch (after the scale)
        take_out_dropout()
        if rank == 0:
            atexit.register(self._write_end)

    # ---- the loop's callbacks (loop/callbacks.py) -------------------------------------------------
    def on_model(self, model: nn.Module) -> None:
        self.unsynced += unsynced_batchnorms(model)
        self.dropout_layers += sum(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())

    def loader_scale(self, split_batches: bool) -> int:
        """The one-process run takes the N processes' global batch (split_batches: it already is)."""
        return 1 if split_batches else self.batch_scale

    def on_loader(self, batch_size: int | None = None) -> None:
        """A prepared loader, with the batch each of its steps gives this rank (None: unknown)."""
        self.prepared_loaders += 1
        if self.batch_size is None:
            self.batch_size = batch_size

    def on_backward(self, loss: torch.Tensor, num_items: Any) -> None:
        if self.rng_digest is None:
            self.rng_digest = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]
        self.loss_sum += float(loss.detach().float())
        if num_items is not None:
            self.items_sum += float(num_items)
        self.num_backward += 1
        self.total_backward += 1

    def before_step(self, step: int, params: Iterable[torch.Tensor]) -> None:
        """Before optimizer step `step`: one line on rank 0; leave after the last step asked for."""
        if self.num_backward == 0:
            return
        norm = gradient_norm(params)
        mine = {
            "loss_sum": self.loss_sum,
            "items": self.items_sum,
            "backward": self.num_backward,
            "seed": torch.initial_seed(),
            "rng": self.rng_digest,
            "unsynced": self.unsynced,
            "dropout_layers": self.dropout_layers,
            "loaders": self.prepared_loaders,
            "batch": self.batch_size,
        }
        self.loss_sum, self.items_sum, self.num_backward = 0.0, 0.0, 0
        ranks = collectives.gather_object(mine)
        self.num_recorded += 1
        if self.rank == 0:
            self._append(step_line(step, norm, ranks, self.world_size, self.batch_scale))
        if self.num_recorded >= self.steps:  # the comparison has what it needs: leave, every rank at once
            raise ParityStop(0)

    def _append(self, line: Mapping[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as fp:
            fp.write(json.dumps(line) + "\n")

    def _write_end(self) -> None:
        self._append({"end": True, "backward_calls": self.total_backward, "steps": self.num_recorded})


def step_line(step: int, norm: float, ranks: list[dict[str, Any]], world_size: int, batch_scale: int) -> dict[str, Any]:
    """The record of one step from every rank's figures: the global loss is Σ loss / Σ num_items
    when items were counted, else the mean over ranks of each rank's mean over its backward calls."""
    items = sum(r["items"] for r in ranks)
    if items > 0:
        loss = sum(r["loss_sum"] for r in ranks) / items
        rank_losses = [r["loss_sum"] / r["items"] if r["items"] else None for r in ranks]
    else:
        rank_losses = [r["loss_sum"] / r["backward"] for r in ranks]
        loss = sum(rank_losses) / len(rank_losses)
    return {
        "step": step,
        "loss": loss,
        "grad_norm": norm,
        "rank_losses": rank_losses,
        "world_size": world_size,
        "batch_scale": batch_scale,
        "seeds": [r["seed"] for r in ranks],
        "rng": [r["rng"] for r in ranks],
        "unsynced_batchnorm": ranks[0]["unsynced"],
        "dropout_layers": ranks[0]["dropout_layers"],
        "prepared_loaders": ranks[0]["loaders"],
        "global_batch": None if any(r.get("batch") is None for r in ranks) else sum(r["batch"] for r in ranks),
    }


def gradient_norm(params: Iterable[torch.Tensor]) -> float:
    """The global 2-norm of the gradients on every rank. A sharded (DTensor) gradient's norm is
    gathered per parameter: slow, exact for any mesh (hsdp's replicas are not counted twice)."""
    squares = 0.0
    for p in params:
        if p.grad is None:
            continue
        norm = torch.linalg.vector_norm(p.grad.detach().float())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    return squares**0.5


def take_out_dropout() -> None:
    """Functional dropout (which nn.Dropout calls) returns its input, and scaled_dot_product_attention
    drops nothing: no randomness in either run."""
    for name in _DROPOUTS:
        setattr(F, name, _identity)
    attention = F.scaled_dot_product_attention
    if getattr(attention, "_phalanx_no_dropout", False):
        return

    def without_dropout(
        query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, *args: Any, **kwargs: Any
    ) -> Any:
        return attention(query, key, value, attn_mask, 0.0, *args, **kwargs)

    without_dropout._phalanx_no_dropout = True  # type: ignore[attr-defined]
    F.scaled_dot_product_attention = without_dropout


def _identity(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return input


def from_request(request: ParityRequest | None, rank: int, world_size: int) -> ParityRecorder | None:
    """A recorder when `phalanx parity` runs this worker (runtime/context.py's parity_request)."""
    if request is None:
        return None
    return ParityRecorder(request.record_path, request.steps, request.batch_scale, rank, world_size)
