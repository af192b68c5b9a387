"""Training runs for the router load-balancing loss test: tiny Qwen3-MoE and Mixtral (4 experts, top
2, `output_router_logits=True`, router_aux_loss_coef 0.1) trained with transformers' own loop
(`labels=`, torch's `clip_grad_norm_`, AdamW) in a layout, and the same loop in one process with no
phalanx on the whole batches, computed in rank 0."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from phalanx import Phalanx
from tests.dist.ep_workloads import make_model

STEPS, BATCH, LR, MAX_NORM, COEF = 4, 8, 1e-2, 1.0, 0.1
SAMPLES, SEQ, VOCAB = 32, 12, 64


class Rows(Dataset):
    """Token rows; with `padded`, rows whose index is 2 or 3 mod 4 end in 3 padding tokens (masked,
    label -100): every rank's share of a batch then holds as many targets as another's, so the
    averaged per-rank token means equal one process's and only the router loss tells layouts apart."""

    def __init__(self, padded: bool):
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.padded = padded

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i]
        if not self.padded:
            return {"input_ids": ids, "labels": ids}
        mask = torch.ones(SEQ, dtype=torch.long)
        if (i // 2) % 2:
            mask[-3:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _model(family: str) -> nn.Module:
    model = make_model(family, aux=COEF)
    return model


def _norm(value: Any) -> float:
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _loop(
    model: nn.Module, optimizer: Any, batches: Any, backward: Any, mean: Any, cut: Any = lambda batch: batch
) -> dict[str, list[float]]:
    losses, norms, aux = [], [], []
    for batch in batches:
        out = model(**cut(batch))
        backward(out.loss)
        norms.append(_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(mean(out.loss.detach())))
        aux.append(float(_norm(out.aux_loss.detach())))
        if len(losses) == STEPS:
            break
    return {"losses": losses, "norms": norms, "aux": aux}


def _world_mean(loss: torch.Tensor) -> torch.Tensor:
    """Every rank's loss averaged (under cp each holds its share of the rows' mean)."""
    import torch.distributed as dist

    loss = loss.clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def in_join(family: str, **settings: Any) -> dict[str, Any]:
    """A training forward inside torch's Join (px.uneven_inputs under ddp): what it raises."""
    px = Phalanx(**settings)
    model = px.prepare(_model(family))
    batches = [Rows(False)[i] for i in range(2 + px.rank)]  # rank-dependent: the case Join is for
    try:
        with px.uneven_inputs(model) as uneven:
            for row in uneven.iter(batches):
                model(**{k: v.unsqueeze(0) for k, v in row.items()}).loss.backward()
    except ValueError as error:
        return {"refused": str(error)}
    return {}


def train(family: str, padded: bool = False, join: bool = False, **settings: Any) -> dict[str, Any]:
    """STEPS AdamW steps under `settings`; rank 0 adds the one-process run with no phalanx."""
    if join:
        return in_join(family, **settings)
    px = Phalanx(**settings)
    model = _model(family)
    start = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(Rows(padded), batch_size=BATCH // px.dp_size)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    if px.cp_size > 1:  # the docs' hand-written cp loop: this rank's part of the rows, labels= kept
        out: dict[str, Any] = _loop(
            model, optimizer, loader, px.backward, _world_mean, cut=lambda batch: px.shard_sequence(batch)[0]
        )
    else:
        out = _loop(model, optimizer, loader, px.backward, lambda loss: px.reduce(loss, "mean"))
    if px.rank == 0:
        ref_opt = torch.optim.AdamW(start.parameters(), lr=LR)
        whole = DataLoader(Rows(padded), batch_size=BATCH)
        out["reference"] = _loop(start, ref_opt, whole, lambda loss: loss.backward(), lambda loss: loss)
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank: one process group serves them all."""
    return {name: train(**kwargs) for name, kwargs in cases.items()}
