"""Rank functions for test_user_surface.py (issue 51): loops written as torch's and transformers' docs write
them, around what `px.prepare` returns, on 2 ranks; each against the same loop in plain torch in one
process (`one_process_*`, computed in the test process with no phalanx).

- a stream split over DataLoader workers by torch's docs' `get_worker_info()` example, 0 and 2 workers:
  the items of each step, the losses and the final weights;
- an LR scheduler built on the user's optimizer before `px.prepare` and not passed to it (transformers'
  `get_linear_schedule_with_warmup`, a warmup from lr 0), under ddp, zero1 and zero3: the lr the
  optimizer phalanx steps uses, and the final weights;
- transformers' `model(**batch).loss` with `labels=` -100 on uneven padding (rank 0 holds most of the
  real tokens), a tiny Llama under ddp and a tiny Qwen3-MoE under ep 2: losses, grad norms (torch's
  clip_grad_norm_) and weights; with average_tokens_across_ranks=False, the ranks' means averaged.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from tests.data_counts import WorkerSplit
from tests.idioms import models

N_STREAM, GLOBAL_BATCH, LR = 32, 8, 0.05
SCHEDULE_STEPS, WARMUP = 4, 2


class RangeStream(WorkerSplit):
    """torch.utils.data's docs, example 1 (`get_worker_info()` splits the range over the workers), each
    item (x, y, its index) from a fixed table of regression pairs."""

    def item(self, index: int) -> tuple:
        x, y = models.pairs(N_STREAM).tensors
        return x[index], y[index], index


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's weights, whole (zero3's are DTensor shards)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _stream_loop(model, optimizer, loader, talk=None) -> dict:
    steps, losses = [], []
    for x, y, index in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        steps.append(sorted(int(i) for i in (talk.gather(index) if talk is not None else index)))
        losses.append(float(talk.reduce(loss.detach()) if talk is not None else loss.detach()))
    return {"steps": steps, "losses": losses}


def one_process_stream(workers: int) -> dict:
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = _stream_loop(
        model, optimizer, DataLoader(RangeStream(0, N_STREAM), batch_size=GLOBAL_BATCH, num_workers=workers)
    )
    return {**out, "weights": [p.detach().clone() for p in model.parameters()]}


def _stream(px, workers: int) -> dict:
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(RangeStream(0, N_STREAM), batch_size=GLOBAL_BATCH // px.dp_size, num_workers=workers)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    out = _stream_loop(model, optimizer, loader, px)
    return {**out, "weights": _full(px.unwrap_model(model))}


def _schedule_loop(model, optimizer, scheduler, batches) -> dict:
    lrs, shown = [], []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        lrs.append(optimizer.param_groups[0]["lr"])  # the lr of the optimizer that steps
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        shown.append(scheduler.get_last_lr()[0])
    return {"lrs": lrs, "shown": shown}


def _global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = models.pairs(N_STREAM).tensors
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, N_STREAM, GLOBAL_BATCH)]


def one_process_schedule() -> dict:
    from transformers import get_linear_schedule_with_warmup

    model = models.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, SCHEDULE_STEPS)
    out = _schedule_loop(model, optimizer, scheduler, _global_batches())
    return {**out, "weights": [p.detach().clone() for p in model.parameters()]}


def _schedule(px) -> dict:
    from transformers import get_linear_schedule_with_warmup

    model = models.mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, SCHEDULE_STEPS)  # built before prepare
    model, prepared = px.prepare(model, optimizer)  # the scheduler is not passed
    share = GLOBAL_BATCH // px.dp_size
    mine = [(x[px.dp_rank * share :][:share], y[px.dp_rank * share :][:share]) for x, y in _global_batches()]
    out = _schedule_loop(model, prepared, scheduler, mine)
    return {**out, "weights": _full(px.unwrap_model(model))}


# ---- labels= with uneven padding: each rank's real tokens differ ---------------------------------------
SEQ, ROWS = 12, 4  # a global batch of 4 rows: rank r of 2 holds rows 2r and 2r + 1
LENGTHS = [[12, 11, 4, 3], [10, 12, 2, 5]]  # real tokens per row, per step: rank 0 holds most of them


def padded_batches() -> list[dict[str, torch.Tensor]]:
    """transformers' padded batches: input_ids, attention_mask and labels -100 on the padding, per step."""
    g = torch.Generator().manual_seed(2)
    out = []
    for lengths in LENGTHS:
        ids = torch.randint(1, 64, (ROWS, SEQ), generator=g)
        mask = (torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
        ids = ids * mask
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _labels_loop(model, optimizer, batches, backward, reduce=lambda x: x) -> dict:
    losses, norms = [], []
    for batch in batches:
        loss = model(**batch).loss
        backward(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(reduce(loss.detach())))
    return {"losses": losses, "norms": norms}


def one_process_labels(family: str) -> dict:
    """The same loop in plain transformers, one process, over the global batches."""
    model = models.llama() if family == "llama" else models.qwen3_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = _labels_loop(model, optimizer, padded_batches(), lambda loss: loss.backward())
    return {**out, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def one_process_rank_means() -> float:
    """The step-0 grad norm of the two ranks' means averaged (what average_tokens_across_ranks=False keeps)."""
    model = models.llama()
    batch = padded_batches()[0]
    halves = [{k: v[r * 2 : r * 2 + 2] for k, v in batch.items()} for r in range(2)]
    (sum(model(**half).loss for half in halves) / 2).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))


def _labels(px, family: str, steps: int = 2) -> dict:
    model = models.llama() if family == "llama" else models.qwen3_moe()
    model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    mine = [{k: v[px.dp_rank * 2 : px.dp_rank * 2 + 2] for k, v in b.items()} for b in padded_batches()[:steps]]
    # px.backward under ddp; transformers' own loss.backward() under ep
    backward = px.backward if family == "llama" else (lambda loss: loss.backward())
    out = _labels_loop(model, optimizer, mine, backward, px.reduce)
    return {**out, "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()}}


def suite() -> dict:
    import warnings

    from phalanx import Phalanx

    warnings.filterwarnings(
        "ignore", message="Detected call of `lr_scheduler.step()`"
    )  # the user's optimizer never steps
    out: dict = {}
    for workers in (0, 2):
        out[f"stream-{workers}"] = _stream(Phalanx(strategy="ddp", seed=3), workers)
    for strategy in ("ddp", "zero1", "zero3"):
        out[f"schedule-{strategy}"] = _schedule(Phalanx(strategy=strategy, seed=3))
    out["labels-ddp"] = _labels(Phalanx(strategy="ddp"), "llama")
    out["labels-ep"] = _labels(Phalanx(strategy="ddp", ep=2), "moe")
    out["labels-rank-means"] = _labels(Phalanx(strategy="ddp", average_tokens_across_ranks=False), "llama", steps=1)
    return out
