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
    return TensorDataset(
        torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    )


def make_optimizer(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only (two param groups)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def train(
    strategy: str | None = None,
    global_batch: int = 16,
    epochs: int = 2,
    accum: int | None = None,
    clip: float | None = None,
    mixed_precision: str | None = None,
    options: dict | None = None,
    deepspeed: dict | None = None,
    lr: float = 1e-2,
    checkpoint: str | None = None,
    full_optimizer: bool = False,
) -> dict[str, Any]:
    """AdamW on TinyNet; returns the full weights, losses, clip norms and model-state bytes.
    With `checkpoint`, also saves there and reports whether a fresh run restores the same state."""

    def build(seed: int = 0):
        px = Phalanx(
            strategy=strategy,
            mixed_precision=mixed_precision,
            grad_accum_steps=accum,
            deepspeed=deepspeed,
            strategy_options=options,
        )
        model = make_model(seed)
        optimizer = make_optimizer(model, lr)
        micro = global_batch // (px.world_size * px.grad_accum_steps)
        loader = DataLoader(make_data(), batch_size=micro, shuffle=True)
        return (px, *px.prepare(model, optimizer, loader))

    px, model, optimizer, loader = build()
    losses, norms, unsynced, exchanged = [], [], [], []
    for _ in range(epochs):
        for x, y in loader:
            with px.accumulate(model):
                optimizer.zero_grad()  # before the forward: must not clear a cycle's gradients
                loss = nn.functional.cross_entropy(model(x), y)
                px.backward(loss)
                if not px.sync_gradients:  # what a skipped sync leaves: local grads, or none yet
                    held_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
                    fsdp = {n: g for n, g in held_grads.items() if n != "embed.weight" or not looked_up(model)}
                    unsynced.append(None if not fsdp else float(sum(g.double().abs().sum() for g in fsdp.values())))
                    exchanged.append(sorted(set(held_grads) - set(fsdp)))
                if clip is not None:
                    norm = px.clip_grad_norm_(model.parameters(), clip)
                    if norm is not None:
                        norms.append(float(norm))
                optimizer.step()
            losses.append(px.reduce(loss.detach().float(), "mean").item())
    held = px.memory_report(model, optimizer)  # after the last step, gradients still held
    restored = None
    if checkpoint is not None:
        px.save_state(checkpoint)
        px2, model2, optimizer2, _ = build(seed=1)  # different initial weights, then restored
        assert px2.load_state(checkpoint)
        mine, theirs = px.get_state_dict(model), px2.get_state_dict(model2)
        restored = {
            "global_step": (px.global_step, px2.global_step),
            "manifest_strategy": px2.strategy_name,
            "weights_equal": mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine),
            "optimizer_equal": _optimizer_states_equal(optimizer, optimizer2),
        }
    return {
        "strategy": px.strategy_name,
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "losses": losses,
        "norms": norms,
        "unsynced": unsynced,
        "exchanged": exchanged,
        "bytes": vars(held).copy(),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "is_optimizer": isinstance(optimizer, torch.optim.Optimizer),
        "restored": restored,
        "optim_full": full_optimizer_state(model, optimizer) if full_optimizer else None,
    }


def looked_up(model: nn.Module) -> bool:
    """The model's embedding is looked up where its rows live (zero2/zero3, embedding_exchange=auto)."""
    from phalanx.strategies.sharded_embedding import ShardedLookupEmbedding

    return isinstance(model.embed, ShardedLookupEmbedding)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's state as full tensors keyed by parameter name, on every rank, any strategy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from phalanx.checkpoint.state import base_optimizer

    state = get_optimizer_state_dict(model, base_optimizer(optimizer), options=StateDictOptions(full_state_dict=True))
    return {
        name: {k: v.detach().clone().float() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        for name, values in state["state"].items()
    }


def resume_under(strategy: str, checkpoint: str, options: dict | None = None, global_batch: int = 16) -> dict[str, Any]:
    """A fresh run under `strategy` (other initial weights) restored from `checkpoint`, with the
    saved run's global batch (`train`'s), as the resume contract requires."""
    px = Phalanx(strategy=strategy, strategy_options=options)
    model = make_model(seed=1)
    optimizer = make_optimizer(model)
    loader = DataLoader(make_data(), batch_size=global_batch // px.world_size, shuffle=True)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    assert px.load_state(checkpoint)
    return {
        "strategy": px.strategy_name,
        "global_step": px.global_step,
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "optim_full": full_optimizer_state(model, optimizer),
    }


def _optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    sa, sb = list(a.state.values()), list(b.state.values())
    return len(sa) == len(sb) > 0 and all(torch.equal(local(x[k]), local(y[k])) for x, y in zip(sa, sb) for k in x)


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Run every case, in order, in this rank; one process group serves them all."""
    return {name: train(**kwargs) for name, kwargs in cases.items()}
