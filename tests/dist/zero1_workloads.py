"""zero1's memory and gathers: chunks that are views of the parameters, gathers in many small
buckets or one persistent buffer, and checkpoints loaded into zero1 that the first step keeps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import Phalanx
from phalanx.loop.accumulation import unwrap_optimizer
from phalanx.strategies.optimizers import zero1_buckets
from tests.dist import strategy_workloads as w


CLIP = 0.05  # binds on every step (test_strategies.py's)


def _held(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    inner = unwrap_optimizer(optimizer)
    slots = inner._slots
    return {
        "buckets": len(inner._buckets),
        "buffer_bytes": inner.buffer_bytes(),
        "padded_numel": sum(s.padded for s in slots),
        # every chunk the optimizer steps lives inside its parameter's own storage
        "chunks_share_params": all(
            s.chunk.untyped_storage().data_ptr() == s.full.untyped_storage().data_ptr() for s in slots
        ),
    }


def gathers() -> dict[str, Any]:
    """TinyNet under zero1 with buckets of 256 bytes (one all-gather per few rows), and with the
    persistent buffer: trained results (as strategy_workloads.train) and what each holds."""
    out: dict[str, Any] = {}
    default = zero1_buckets.GATHER_BUCKET_BYTES
    try:
        zero1_buckets.GATHER_BUCKET_BYTES = 256
        out["tiny buckets"] = w.train("zero1")
        px = Phalanx(strategy="zero1")
        model = w.make_model()
        _, optimizer = px.prepare(model, w.make_optimizer(model))
        out["tiny buckets held"] = _held(optimizer)
    finally:
        zero1_buckets.GATHER_BUCKET_BYTES = default
    direct = zero1_buckets.DIRECT_NUMEL
    try:  # gloo's default for large parameters, here for every one: broadcasts into their rows
        zero1_buckets.DIRECT_NUMEL = 1
        out["direct"] = w.train("zero1")
    finally:
        zero1_buckets.DIRECT_NUMEL = direct
    # zero1_grads reduce_scatter: gradients reduce-scattered to their owners, clipping by their norms
    out["scattered, clipped"] = w.train("zero1", clip=CLIP, options={"zero1_grads": "reduce_scatter"})
    out["persistent"] = w.train("zero1", options={"zero1_gather": "persistent"})
    px = Phalanx(strategy="zero1", zero1_gather="persistent")
    model = w.make_model()
    model, optimizer = px.prepare(model, w.make_optimizer(model))
    out["persistent held"] = _held(optimizer)
    out["persistent report"] = vars(px.memory_report(model, optimizer)).copy()
    px = Phalanx(strategy="zero1")
    model = w.make_model()
    model, optimizer = px.prepare(model, w.make_optimizer(model))
    out["bucketed held"] = _held(optimizer)
    out["bucketed report"] = vars(px.memory_report(model, optimizer)).copy()
    return out


def _batch(px: Phalanx, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + px.rank)
    return torch.randint(0, w.VOCAB, (4, w.SEQ), generator=g), torch.randint(0, w.CLASSES, (4,), generator=g)


def _step(px: Phalanx, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(px, step)
    optimizer.zero_grad()
    px.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()


def load_then_step(checkpoint_root: str) -> dict[str, Any]:
    """Run A trains 2 steps under `saved_by`, saves, takes step 3; run B (zero1, other initial
    weights) loads the checkpoint and takes the same step 3. B must equal A: the loaded weights
    are what zero1 steps from, not B's own initial ones."""
    out = {}
    for saved_by in ("zero1", "ddp"):
        checkpoint = f"{checkpoint_root}/{saved_by}"
        px = Phalanx(strategy=saved_by)
        model = w.make_model(seed=0)
        model, optimizer = px.prepare(model, w.make_optimizer(model))
        for step in (1, 2):
            _step(px, model, optimizer, step)
        px.save_state(checkpoint)
        _step(px, model, optimizer, 3)
        expected = {k: v.clone() for k, v in px.get_state_dict(model).items()}
        px2 = Phalanx(strategy="zero1")
        model2 = w.make_model(seed=1)
        model2, optimizer2 = px2.prepare(model2, w.make_optimizer(model2))
        assert px2.load_state(checkpoint)
        _step(px2, model2, optimizer2, 3)
        out[saved_by] = {"expected": expected, "resumed": {k: v.clone() for k, v in px2.get_state_dict(model2).items()}}
    return out
