"""Training runs for the strategy tests: the same loop under any strategy, on any world size.

`train(case)` runs in each rank (via tests.dist.harness) and in-process as the world-of-one
reference; `matrix(cases)` runs many cases in ONE 2-rank launch (one process group, many
strategies in sequence) to keep spawn costs down.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

VOCAB, DIM, SEQ, CLASSES, SAMPLES = 32, 16, 6, 4, 64


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    """Embedding + 2 residual blocks + head: the shape of a small transformer, without attention."""

    def __init__(self, num_blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(num_blocks))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyNet()


def make_data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def train(strategy: str | None = None, global_batch: int = 16, epochs: int = 2, accum: int | None = None,
          clip: float | None = None, mixed_precision: str | None = None, options: dict | None = None,
          deepspeed: dict | None = None, lr: float = 1e-2) -> dict[str, Any]:
    """AdamW on TinyNet; returns the full weights, losses, clip norms and model-state bytes."""
    px = Phalanx(strategy=strategy, mixed_precision=mixed_precision, grad_accum_steps=accum,
                 deepspeed=deepspeed, strategy_options=options)
    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    micro = global_batch // (px.world_size * px.grad_accum_steps)
    loader = DataLoader(make_data(), batch_size=micro, shuffle=True)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    losses, norms, unsynced = [], [], []
    for _ in range(epochs):
        for x, y in loader:
            with px.accumulate(model):
                optimizer.zero_grad()  # before the forward: must not clear a cycle's gradients
                loss = nn.functional.cross_entropy(model(x), y)
                px.backward(loss)
                if not px.sync_gradients:  # what a skipped sync leaves: local grads, or none yet
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    unsynced.append(None if not grads else float(sum(g.double().abs().sum() for g in grads)))
                if clip is not None:
                    norm = px.clip_grad_norm_(model.parameters(), clip)
                    if norm is not None:
                        norms.append(float(norm))
                optimizer.step()
            losses.append(px.reduce(loss.detach().float(), "mean").item())
    held = px.memory_report(model, optimizer)  # after the last step, gradients still held
    return {
        "strategy": px.strategy_name,
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "losses": losses, "norms": norms, "unsynced": unsynced, "bytes": vars(held).copy(),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "is_optimizer": isinstance(optimizer, torch.optim.Optimizer),
    }


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Run every case, in order, in this rank; one process group serves them all."""
    return {name: train(**kwargs) for name, kwargs in cases.items()}
