"""Rank functions for issue 51: torch's own calls on what px.prepare returned (`torch.save` of
`model.state_dict()` and `optimizer.state_dict()`, `load_state_dict`, `with model.no_sync():`, torch's
clip under pp, `torch.compile(model)` before prepare, a batch of no rows through a transformers
model), each compared with the same loop in plain torch in one process, no phalanx."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from phalanx import Phalanx
from tests.idioms.models import VOCAB
from tests.idioms.models import llama as tiny_llama  # transformers' Llama, 2 layers, untied

SEQ, ROWS = 8, 2


def batch(step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """The rows data-parallel rank `dp_rank` reads at micro-step `micro` of optimizer step `step`."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, dp_size: int) -> None:
    """One process: the step's 2 micro-steps of every data-parallel rank's rows, gradients averaged
    over the ranks and summed over the micro-steps (DDP's no_sync accumulation)."""
    for micro in range(2):
        for r in range(dp_size):
            (_loss(model, batch(step, micro, r)) / dp_size).backward()
    optimizer.step()
    optimizer.zero_grad()


def _step_with_no_sync(px: Phalanx, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """DDP's documented accumulation: the first micro-step inside `model.no_sync()`."""
    with model.no_sync():
        _loss(model, batch(step, 0, px.dp_rank)).backward()
    _loss(model, batch(step, 1, px.dp_rank)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _max_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of a tensor, relative to that tensor's largest value."""
    return max(
        ((got[k].float() - v.float()).abs().max() / v.float().abs().max().clamp_min(1e-12)).item()
        for k, v in expected.items()
    )


def save_and_resume(settings: dict[str, Any], directory: str) -> dict[str, Any]:
    """Step 0 with no_sync accumulation; `torch.save` of the prepared model's and optimizer's
    state_dict() on the main process; then, in this process without phalanx, a plain Llama and SGD with momentum (state linear in the gradients, so
    tensor parallel's rounding is not amplified as Adam's first steps amplify it)
    load those files and take step 1, against one process that took both steps. Last,
    `load_state_dict` of one process's full state into the prepared model reads back equal."""
    px = Phalanx(**settings)
    model = tiny_llama()
    optimizer = _optimizer(model)
    model, optimizer = px.prepare(model, optimizer)
    _step_with_no_sync(px, model, optimizer, 0)
    # under ddp and zero1 the prepared model is torch's DDP: its .module's keys are the model's
    state, optim_state = getattr(model, "module", model).state_dict(), optimizer.state_dict()
    out: dict[str, Any] = {
        "types": sorted({type(v).__name__ for v in state.values()}),
        "optimizer_types": sorted({type(v).__name__ for s in optim_state["state"].values() for v in s.values()}),
    }
    if px.is_main_process:
        torch.save(state, os.path.join(directory, "model.pt"))
        torch.save(optim_state, os.path.join(directory, "optim.pt"))
    px.wait_for_everyone()

    reference = tiny_llama()
    ref_opt = _optimizer(reference)
    reference_step(reference, ref_opt, 0, px.dp_size)
    expected = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    out["keys_equal"] = sorted(state) == sorted(expected)
    out["after_step0"] = _max_diff(state, expected)

    resumed = tiny_llama()  # a script in one process, no phalanx: torch's tutorial resume
    resumed.load_state_dict(torch.load(os.path.join(directory, "model.pt")))
    resumed_opt = _optimizer(resumed)
    resumed_opt.load_state_dict(torch.load(os.path.join(directory, "optim.pt")))
    reference_step(resumed, resumed_opt, 1, px.dp_size)
    reference_step(reference, ref_opt, 1, px.dp_size)
    out["resumed_step1"] = _max_diff(resumed.state_dict(), reference.state_dict())

    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    getattr(model, "module", model).load_state_dict(full)  # one process's full state into the prepared model
    optimizer.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (torch's load keeps its `step` tensors)
    out["loaded_back"] = _max_diff(getattr(model, "module", model).state_dict(), full)
    got, want = optimizer.state_dict(), ref_opt.state_dict()
    out["optimizer_loaded_back"] = max(_max_diff(got["state"][i], want["state"][i]) for i in want["state"])
    _step_with_no_sync(px, model, optimizer, 2)  # and training goes on from it as one process would
    reference_step(reference, ref_opt, 2, px.dp_size)
    out["after_step2"] = _max_diff(getattr(model, "module", model).state_dict(), reference.state_dict())
    return out


def _next_token_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def pipeline_state(settings: dict[str, Any]) -> dict[str, Any]:
    """pp: the stage model's state_dict() and its optimizer's are refused with the way; a full
    state from one process loads each rank's stages; torch's clip_grad_norm_ on the prepared
    model's parameters returns the whole model's norm where a norm by hand over p.grad is one stage's."""
    px = Phalanx(**settings)
    model = tiny_llama()
    optimizer = _optimizer(model)
    model, optimizer = px.prepare(model, optimizer)
    out: dict[str, Any] = {}
    for name, call in (("model", model.state_dict), ("optimizer", optimizer.state_dict)):
        try:
            call()
        except ValueError as error:
            out[f"{name}_refused"] = str(error)
    reference = tiny_llama()
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.5)
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    model.load_state_dict(full)
    own = nn.Module.state_dict(model)  # this rank's stages, as the class gives them
    out["stage_keys"] = len(own)
    out["stage_loaded"] = _max_diff({k: v for k, v in own.items()}, {k: full[k] for k in own})

    ids = torch.cat([batch(0, 0, 0), batch(0, 1, 0)])
    px.forward_backward(model, ids[:, :-1], ids[:, 1:], _next_token_loss)
    out["clip_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    out["hand_norm"] = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm().item()
    _next_token_loss(reference(ids[:, :-1]), ids[:, 1:]).backward()
    out["one_process_norm"] = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    return out


BACKEND = "aot_eager"  # torch.compile's graphs and autograd, without inductor's C++ build (minutes on CPU)


def compiled_steps(optimizer: torch.optim.Optimizer, forward_backward: Any) -> None:
    """2 SGD steps on 4 rows each: `forward_backward(rows)` runs the loss and its backward."""
    for step in range(2):
        forward_backward(torch.cat([batch(step, 0, 0), batch(step, 1, 0)]))
        optimizer.step()
        optimizer.zero_grad()


def compiled_reference() -> dict[str, torch.Tensor]:
    """One process: `torch.compile(model)`, then the steps."""
    model = torch.compile(tiny_llama(), backend=BACKEND)

    def forward_backward(rows: torch.Tensor) -> None:
        _next_token_loss(model(rows[:, :-1]), rows[:, 1:]).backward()

    compiled_steps(torch.optim.SGD(model.parameters(), lr=0.5), forward_backward)
    return {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in model.state_dict().items()}


def compiled_before_prepare(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`model = torch.compile(model)` then px.prepare, in each layout of `cases`; the main process's
    full weights after the steps (or the error a layout raised)."""
    out: dict[str, Any] = {}
    for name, settings in cases.items():
        px = Phalanx(**settings)
        try:
            model = px.prepare(torch.compile(tiny_llama(), backend=BACKEND))
        except Exception as error:  # noqa: BLE001 - what the script would see, reported to the test
            out[name] = f"{type(error).__name__}: {error}"
            continue

        def forward_backward(rows: torch.Tensor, px: Phalanx = px, model: nn.Module = model) -> None:
            mine = rows.chunk(px.dp_size)[px.dp_rank]  # this rank's rows of the global batch
            px.forward_backward(model, mine[:, :-1], mine[:, 1:], _next_token_loss)

        compiled_steps(px.prepare(torch.optim.SGD(model.parameters(), lr=0.5)), forward_backward)
        out[name] = {k: v.detach().clone() for k, v in px.get_state_dict(model).items()}
    return out


def _five_rows() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (5, SEQ), generator=g))


def short_last_batch_reference() -> dict[str, Any]:
    """One process: 5 rows in batches of 4, transformers' `labels=` loss."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for (ids,) in torch.utils.data.DataLoader(_five_rows(), batch_size=4):
        _loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"items": 5, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def short_last_batch(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The same loop on 2 ranks, 2 rows each: the last step leaves rank 1 no rows (its batch is
    padding), which transformers' attention cannot reshape."""
    out: dict[str, Any] = {}
    for name, settings in cases.items():
        px = Phalanx(**settings)
        model = tiny_llama()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = torch.utils.data.DataLoader(_five_rows(), batch_size=2)
        model, optimizer, loader = px.prepare(model, optimizer, loader)
        items, rows = 0, []
        for (ids,) in loader:
            rows.append(len(ids))
            items += len(ids)
            px.backward(_loss(model, ids))
            optimizer.step()
            optimizer.zero_grad()
        state = px.get_state_dict(model)
        out[name] = {
            "rows": rows,
            "items": int(px.reduce(torch.tensor(items), "sum")),
            "state": {k: v.detach().clone() for k, v in state.items()},
        }
    return out
