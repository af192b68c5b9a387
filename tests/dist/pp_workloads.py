"""Pipeline parallel through Phalanx's settings and `px.forward_backward`: the same loop in every
layout (accumulation, clipping by the global norm, two parameter groups, an optimizer built before
prepare), with a one-process reference computed in rank 0 on the same global batches."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx
from tests.dist.tp_workloads import SEQ, VOCAB, TinyLM, lm_loss

SAMPLES = 96  # 12 global batches of 8
MAX_NORM = 0.1  # below every step's gradient norm: clipping acts on each step
EVAL_SAMPLES = 12  # px.forward's batch: another size than training's, cut into as many microbatches as divide it


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g))


def make_model(layers: int, head_bias: bool = False) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(layers)
    if head_bias:  # its output over (batch, tokens, dim) is then a view (addmm, then view): FSDP2 warns of those
        model.head = nn.Linear(model.head.in_features, model.head.out_features)
    return model


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW in three groups: the embedding alone at half the rate (a group that is empty on every
    stage but the first), then weight decay on the other matrices only."""
    named = [(n, p) for n, p in model.named_parameters() if n != "embed.weight"]
    return torch.optim.AdamW(
        [
            {"params": [model.embed.weight], "lr": lr / 2, "weight_decay": 0.0},
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
    )


def eval_inputs() -> torch.Tensor:
    return make_data().tensors[0][:EVAL_SAMPLES, :-1]


def reference(
    layers: int,
    global_batch: int,
    steps: int,
    accum: int = 1,
    lr: float = 1e-2,
    start: nn.Module | None = None,
    mixed_precision: str | None = None,
) -> dict[str, Any]:
    """One process, no Phalanx: `steps` optimizer steps, each over `accum` global batches; with
    mixed_precision "bf16" the forward runs under autocast(bf16), as each stage's does."""
    import contextlib

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision == "bf16" else contextlib.nullcontext()

    model = start if start is not None else make_model(layers)
    optimizer = make_optimizer(model, lr)
    batches = iter(DataLoader(make_data(), batch_size=global_batch))
    losses, norms = [], []
    for _ in range(steps):
        for _ in range(accum):
            (batch,) = next(batches)
            with autocast():
                output = model(batch[:, :-1])
            loss = lm_loss(output, batch[:, 1:])
            (loss / accum).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad(), autocast():
        evaluated = model(eval_inputs())
    return {
        "losses": losses,
        "norms": norms,
        "eval": evaluated,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def train(
    layers: int = 2,
    global_batch: int = 8,
    steps: int = 5,
    accum: int = 1,
    lr: float = 1e-2,
    checkpoint: str | None = None,
    resume: str | None = None,
    meta: bool = False,
    evaluate: bool = True,
    head_bias: bool = False,
    **settings: Any,
) -> dict[str, Any]:
    """`steps` optimizer steps through px.forward_backward in the layout `settings` describe (a
    resume first restores `resume` and goes on from its position); rank 0 also returns the one-process
    reference over the same batches, from the start."""
    px = Phalanx(grad_accum_steps=accum, **settings)
    start = make_model(layers, head_bias)
    with px.init_module() if meta else torch.device("cpu"):  # on meta: initialised at prepare from seed 0
        model = make_model(layers, head_bias)
    optimizer = make_optimizer(model, lr)
    loader = DataLoader(make_data(), batch_size=global_batch // px.dp_size)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    done = 0
    if resume is not None:
        assert px.load_state(resume)
        done = px.global_step
    losses, norms, seen = [], [], []
    for (batch,) in loader:
        seen.append(batch.clone())
        with px.accumulate(model):
            loss = px.forward_backward(model, batch[:, :-1], batch[:, 1:], lm_loss)
            norm = px.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(px.reduce(loss, "mean").item())
        if norm is not None:
            norms.append(norm.item())
        if len(losses) == steps * accum:
            if checkpoint is not None:
                px.save_state(checkpoint)  # inside the epoch: a resume goes on with its next batch
            break
    evaluated = None
    try:
        with torch.no_grad():
            evaluated = px.forward(model, eval_inputs())
    except ValueError as error:
        if evaluate:
            raise
        evaluated = str(error)
    out = {
        "strategy": px.strategy_name,
        "plan": px.plan.describe(),
        "dp": (px.dp_rank, px.dp_size),
        "losses": losses,
        "norms": norms,
        "seen": seen,
        "global_step": px.global_step,
        "eval": evaluated,
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "own": sorted(n for n, _ in px.unwrap_model(model).named_parameters()),
    }
    try:
        model(batch[:, :-1])
    except RuntimeError as error:
        out["direct_call"] = str(error)
    if px.rank == 0:
        out["reference"] = reference(
            layers, global_batch, done + steps, accum, lr, start, settings.get("mixed_precision")
        )
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank: one process group serves them all. Each case also gives the
    FSDP2 view-tensor warnings it raised (issue 54: twice on a correct pp x zero3 run)."""
    out = {}
    for name, kwargs in cases.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out[name] = train(**kwargs)
        out[name]["view_warnings"] = [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]
    return out


def resume_chain(first: str, second: str, more: int) -> dict[str, dict]:
    """On 2 ranks: zero3 resumes the checkpoint `first` (saved by pp2 x ddp2 on 4), trains `more`
    steps and saves `second`; pp2 resumes that and trains `more` steps more."""
    zero3 = train(steps=more, resume=first, checkpoint=second, strategy="zero3")
    return {"zero3": zero3, "pp2": train(steps=more, resume=second, strategy="ddp", pp=2)}


def refusals() -> dict[str, str]:
    """What pipeline parallel refuses at prepare (or at the first step) on this rank, by case."""
    out = {}
    cases = {
        "unknown split": ({"pp": 2, "pp_split": ["layers.7"]}, 2, None),
        "too few blocks": ({"pp": 2}, 1, None),
        "batch below pp": ({"pp": 2}, 2, 1),
        "dict inputs": ({"pp": 2}, 2, "dict"),
    }
    for name, (settings, layers, extra) in cases.items():
        px = Phalanx(strategy="ddp", **settings)
        try:
            model = px.prepare(make_model(layers))
            if extra == "dict":
                tokens = make_data().tensors[0][:4]
                px.forward_backward(model, {"tokens": tokens[:, :-1]}, tokens[:, 1:], lm_loss)
            elif extra is not None:  # prepared (any batch size), refused at its step
                tokens = next(iter(px.prepare(DataLoader(make_data(), batch_size=extra))))[0]
                px.forward_backward(model, tokens[:, :-1], tokens[:, 1:], lm_loss)
        except (ValueError, TypeError) as error:
            out[name] = str(error)
    return out


def stall_stage_1(watchdog_timeout: float) -> None:
    """pp2 on 2 ranks; at step 3 the rank of stage 1 stops in the script (the watchdog must name it)."""
    import time

    px = Phalanx(strategy="ddp", pp=2, watchdog_timeout=watchdog_timeout)
    model = make_model(2)
    model, optimizer, loader = px.prepare(model, make_optimizer(model, 1e-2), DataLoader(make_data(), batch_size=8))
    for step, (batch,) in enumerate(loader):
        if px.rank == 1 and step == 3:
            time.sleep(1.5)  # heartbeats first
            time.sleep(10**6)
        px.forward_backward(model, batch[:, :-1], batch[:, 1:], lm_loss)
        optimizer.step()
        optimizer.zero_grad()


def load_weights(path: str) -> dict[str, Any]:
    """pp2 on 2 ranks: px.load_model of the whole model's safetensors file loads each rank's stages;
    a torch file, and a file with a key no stage holds, are refused with the reason."""
    px = Phalanx(strategy="ddp", pp=2)
    model = px.prepare(make_model(2))
    result = px.load_model(model, path)
    out: dict[str, Any] = {"loaded": sorted(result.loaded), "state": dict(nn.Module.state_dict(model))}  # this stage's
    for case, source in (
        ("torch file", path.replace(".safetensors", ".pt")),
        ("unexpected", path.replace("model.safetensors", "extra.safetensors")),
    ):
        try:
            px.load_model(model, source)
        except ValueError as error:
            out[case] = str(error)
    return out
