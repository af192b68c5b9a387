"""Training runs for the model-family sweep: transformers models built from small configs (the code
paths of the pretrained checkpoints users load), trained through `px.forward_backward` in a layout,
with a one-process reference computed in rank 0 on the same global batches.

The loop clips with torch's own `torch.nn.utils.clip_grad_norm_` on the prepared model's parameters,
as hand-written loops do: under tensor parallel every parameter is a DTensor, so it works and its
norm is the one-process norm; under pp phalanx routes torch's norm over the pipeline's stages."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx
from tests.layouts.families import build
from tests.dist.tp_workloads import VOCAB, lm_loss, make_data

MAX_NORM = 1.0


def make_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return build(family, vocab_size=VOCAB)


def _norm(value: Any) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


CLIP_VALUE = 0.05  # below some gradients' entries: clip_grad_value_ acts


def reference(
    family: str, global_batch: int, steps: int, lr: float, start: nn.Module, clip_value: bool = False
) -> dict[str, Any]:
    """One process, no Phalanx: the losses, norms and weights the layouts must reproduce."""
    model = start
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    batches = iter(DataLoader(make_data(), batch_size=global_batch))
    for _ in range(steps):
        (batch,) = next(batches)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if clip_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def train(
    family: str,
    global_batch: int = 8,
    steps: int = 6,
    lr: float = 1e-2,
    checkpoint: str | None = None,
    resume: str | None = None,
    late_optimizer: bool = False,
    clip_value: bool = False,
    **settings: Any,
) -> dict[str, Any]:
    """`steps` AdamW steps in the layout `settings` describe, or what prepare refused; `checkpoint`:
    px.save_state there at the end; `resume`: px.load_state from there first (the reference then
    covers the steps before it too, and `losses` are the ones after). `late_optimizer`: the optimizer
    is built from the prepared model's parameters; `clip_value`: torch's clip_grad_value_ after the
    norm clipping (both loops)."""
    px = Phalanx(**settings)
    model = make_model(family)
    start = copy.deepcopy(model)
    loader = DataLoader(make_data(), batch_size=global_batch // px.dp_size)
    try:
        if late_optimizer:
            model, loader = px.prepare(model, loader)
            optimizer = px.prepare(torch.optim.AdamW(model.parameters(), lr=lr))
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            model, optimizer, loader = px.prepare(model, optimizer, loader)
    except ValueError as error:
        return {"refused": str(error)}
    done = 0
    if resume is not None:
        assert px.load_state(resume)
        done = px.global_step
    losses, norms = [], []
    for (batch,) in loader:
        loss = px.forward_backward(model, batch[:, :-1], batch[:, 1:], lm_loss)
        norm = torch.nn.utils.clip_grad_norm_(px.unwrap_model(model).parameters(), MAX_NORM)
        if clip_value:
            torch.nn.utils.clip_grad_value_(px.unwrap_model(model).parameters(), CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(px.reduce(loss, "mean").item())
        norms.append(_norm(norm))
        if len(losses) == steps:
            if checkpoint is not None:
                px.save_state(checkpoint)  # inside the epoch: a resume goes on with its next batch
            break
    out: dict[str, Any] = {
        "plan": px.plan.describe(),
        "losses": losses,
        "norms": norms,
        "keys": sorted(px.get_state_dict(model)),
        "state_dict": sorted(nn.Module.state_dict(px.unwrap_model(model))),  # this rank's names (pp: its stage's)
    }
    if px.rank == 0:
        ref = reference(family, global_batch, done + steps, lr, start, clip_value)
        out["reference"] = {what: values[done:] for what, values in ref.items()}
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank: one process group serves them all."""
    return {name: train(**kwargs) for name, kwargs in cases.items()}
