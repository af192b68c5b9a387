"""Training runs for the composition matrix (tests.layouts.compatibility): one cell = a layout,
a model and a set of features, 6 optimizer steps of a global batch of 8; the reference (`plain`) is
the same loop in plain torch/transformers in one process with no phalanx, on the same global batches.
`world_of_one` is the phalanx loop with no layout settings (`python train.py`), which must equal
`plain` bitwise."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx
from tests.layouts import layout as find_layout
from tests.layouts.compatibility import COMPILE, cell as find_cell
from tests.dist.tp_workloads import VOCAB, make_data as lm_data

STEPS, GLOBAL, STOP, MAX_NORM, LR = 6, 8, 3, 1.0, 1e-2
IGNORE = -100


def make_model(model: str) -> nn.Module:
    if model == "cnn-bn":  # no bias before a BatchNorm: its gradient is 0 up to rounding, which AdamW magnifies
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 4 * 4, 8, bias=False),
            nn.BatchNorm1d(8),
            nn.ReLU(),
            nn.Linear(8, 3),
        )
    from tests.layouts.families import build

    torch.manual_seed(0)
    built = build("llama", vocab_size=VOCAB)
    if model == "llama-lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        built = get_peft_model(built, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return built


def make_data(model: str) -> TensorDataset:
    if model != "cnn-bn":
        return lm_data()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL, 2, 6, 6, generator=g) * 2 + 1
    return TensorDataset(x, torch.randint(0, 3, (len(x),), generator=g))


def _split(model: str, batch: Any, ignore_some: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets; `ignore_some` (num_items): a third of the targets ignored, so ranks and
    micro-steps hold unequal target counts and only token weighting gives the global mean."""
    if model == "cnn-bn":
        return batch[0], batch[1]
    (tokens,) = batch
    targets = tokens[:, 1:].clone()
    if ignore_some:
        targets[targets % 3 == 0] = IGNORE
    return tokens[:, :-1], targets


def _loss(output: Any, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE, reduction=reduction
    )


def _summed_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return _loss(output, targets, "sum")


def _norm(value: Any) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _run(
    settings: dict[str, Any],
    model_name: str,
    features: tuple[str, ...],
    first: int,
    last: int,
    load: str | None = None,
    save: str | None = None,
    preempt_dir: str | None = None,
) -> dict[str, Any]:
    """Optimizer steps first..last (1-based) under `settings`; `load`: px.load_state from there first;
    `save`: px.save_state there after the last step; `preempt_dir`: checkpoint_dir, SIGTERM to this
    process after step STOP (the run ends there with the preemption's SystemExit)."""
    accum = 2 if "accum2" in features else 1
    extra: dict[str, Any] = {"grad_accum_steps": accum, "seed": 0}
    if "bf16" in features:
        extra["mixed_precision"] = "bf16"
    if model_name == "cnn-bn":
        extra["sync_batchnorm"] = True
    if "ac" in features:
        extra["activation_checkpointing"] = True
    if "compile" in features:
        torch._dynamo.reset()  # a fresh process's compile: the cells before compiled the same code
        extra["compile"] = dict(COMPILE)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if preempt_dir is not None:
        extra["checkpoint_dir"] = preempt_dir
    try:
        px = Phalanx(**settings, **extra)
        model = make_model(model_name)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        loader = DataLoader(make_data(model_name), batch_size=GLOBAL // (px.dp_size * accum))
        model, optimizer, loader = px.prepare(model, optimizer, loader)
    except ValueError as error:
        return {"refused": str(error)}
    if load is not None:
        assert px.load_state(load)
        assert px.global_step == first - 1, (px.global_step, first)
    losses: list[float] = []
    norms: list[float] = []
    out: dict[str, Any] = {"plan": px.plan.describe(), "losses": losses, "norms": norms}
    batches = iter(loader)
    try:
        for step in range(first, last + 1):
            micro = []
            for _ in range(accum):
                inputs, targets = _split(model_name, next(batches), "num_items" in features)
                with px.accumulate(model):
                    if "num_items" in features:
                        px.forward_backward(model, inputs, targets, _summed_loss, num_items=(targets != IGNORE).sum())
                    else:
                        micro.append(px.reduce(px.forward_backward(model, inputs, targets, _loss), "mean").item())
            if "clip" in features:
                norms.append(_norm(px.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(px.step_loss if "num_items" in features else sum(micro) / len(micro))
            if preempt_dir is not None and step == STOP:
                os.kill(os.getpid(), signal.SIGTERM)
        if preempt_dir is not None:
            next(batches)  # the boundary where the agreed stop happens
            raise AssertionError("SIGTERM did not stop the run")
    except SystemExit as stop:
        out["exit"] = stop.code
    if "compile" in features:  # what dynamo captured: none would mean the run was eager
        out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    if save is not None:
        px.save_state(save)
    state = px.get_state_dict(model)
    if px.rank == 0:
        out["state"] = {k: v.detach().float().clone() for k, v in state.items()}
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name)


def run_cell(name: str, tmp: str) -> dict[str, Any]:
    """The cell `name` of tests.layouts.compatibility.CELLS in this world."""
    c = find_cell(name)
    settings = find_layout(c.layout).settings
    features = tuple(f for f in c.features if f not in ("resume", "preempt"))
    if "resume" in c.features:
        path = str(Path(tmp) / ("resume-" + _slug(name)))
        before = _run(find_layout(c.resume_from).settings, c.model, features, 1, STOP, save=path)
        if "refused" in before:
            return {"refused": f"saving layout {c.resume_from}: {before['refused']}"}
        after = _run(settings, c.model, features, STOP + 1, STEPS, load=path)
        if "refused" in after:
            return after
        return {**after, "losses": before["losses"] + after["losses"], "norms": before["norms"] + after["norms"]}
    if "preempt" in c.features:
        directory = str(Path(tmp) / ("preempt-" + _slug(name)))
        before = _run(settings, c.model, features, 1, STEPS, preempt_dir=directory)
        if "refused" in before:
            return before
        assert before.get("exit") == 143, before.get("exit")
        latest = sorted(Path(directory).glob("step-*"))[-1]
        stopped = len(before["losses"])  # the agreed step: STOP or a later one
        assert latest.name.endswith(f"{stopped:08d}"), (latest, stopped)
        after = _run(settings, c.model, features, stopped + 1, STEPS, load=str(latest))
        return {
            **after,
            "exit": 143,
            "losses": before["losses"] + after["losses"],
            "norms": before["norms"] + after["norms"],
        }
    return _run(settings, c.model, features, 1, STEPS)


def reference(model: str, features: tuple[str, ...]) -> dict[str, Any]:
    """phalanx's world of one with the same settings: no layout."""
    return _run({}, model, features, 1, STEPS)


def plain(model_name: str, features: tuple[str, ...]) -> dict[str, Any]:
    """`_run`'s 6 steps as plain torch/transformers write them, one process, no phalanx: `(loss /
    accum).backward()` per micro-batch (num_items: the summed loss over the step's target count),
    torch's own clip_grad_norm_, bf16 as autocast around the forward."""
    accum = 2 if "accum2" in features else 1
    model = make_model(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    batches = iter(DataLoader(make_data(model_name), batch_size=GLOBAL // accum))
    bf16 = "bf16" in features
    losses: list[float] = []
    norms: list[float] = []
    for _ in range(STEPS):
        micro = [_split(model_name, next(batches), "num_items" in features) for _ in range(accum)]
        count = sum(int((targets != IGNORE).sum()) for _, targets in micro)
        summed = []
        for inputs, targets in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                output = model(inputs)
            if "num_items" in features:
                loss = _summed_loss(output, targets)
                (loss / count).backward()
            else:
                loss = _loss(output, targets)
                (loss / accum).backward()
            summed.append(loss.item())
        losses.append(sum(summed) / (count if "num_items" in features else accum))
        if "clip" in features:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
    }


def plain_references(keys: list[tuple[str, tuple[str, ...]]]) -> dict[tuple, dict]:
    return {key: plain(*key) for key in keys}


def world_of_one(keys: list[tuple[str, tuple[str, ...]]]) -> dict[tuple, dict]:
    """Each key's loop with phalanx and no layout settings (a world of one, as `python train.py`
    runs it) beside the same loop in plain torch."""
    return {key: {"phalanx": reference(*key), "plain": plain(*key)} for key in keys}


def cells(names: list[str], tmp: str) -> dict[str, dict]:
    """Every cell in order in this world: one process group serves them all."""
    out = {}
    for name in names:
        out[name] = run_cell(name, tmp)
        print(f"cell done: {name}: { ({k: v for k, v in out[name].items() if k != 'state'}) }", flush=True)
    return out
