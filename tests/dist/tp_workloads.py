"""Training runs for the tensor-parallel tests: the same `px.forward_backward` loop in any layout,
with a one-process reference computed in the same rank on the same global batches."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

VOCAB, DIM, SEQ, SAMPLES = 64, 32, 8, 64  # 8 steps of a global batch of 8 per epoch


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        # no q/k/v biases: a key bias shifts every score of a query alike, so its true gradient is 0
        # and AdamW would amplify rounding noise into steps of lr
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 4):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Embedding + a ModuleList of blocks + norm + head; its forward is a plain loop."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


TINY_LM_PLAN = {
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.out": "rowwise",
    "layers.*.up": "colwise",
    "layers.*.down": "rowwise",
    "head": "colwise_gather_output",
}


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=2 * DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return tiny_llama() if kind == "llama" else TinyLM()


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g))


def lm_loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def _inputs(kind: str, batch: torch.Tensor) -> Any:
    return {"input_ids": batch[:, :-1]} if kind == "llama" else batch[:, :-1]


def reference(
    kind: str, global_batch: int, steps: int, lr: float = 1e-2, start: nn.Module | None = None, skip: int = 0
) -> dict[str, Any]:
    """One process, no Phalanx: the losses and weights the layouts must reproduce."""
    model = start if start is not None else make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    batches = iter(DataLoader(make_data(), batch_size=global_batch))
    for _ in range(skip):
        next(batches)
    for _ in range(steps):
        (batch,) = next(batches)
        loss = lm_loss(model(**_inputs(kind, batch)) if kind == "llama" else model(_inputs(kind, batch)), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(
    kind: str,
    global_batch: int = 8,
    steps: int = 5,
    lr: float = 1e-2,
    checkpoint: str | None = None,
    resume: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """`steps` AdamW steps through px.forward_backward in the layout `settings` describe (a resume
    first restores `resume`); rank 0 also returns the one-process reference on the same batches."""
    px = Phalanx(**settings)
    model = make_model(kind)
    start = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = DataLoader(make_data(), batch_size=global_batch // px.dp_size)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    done = 0
    if resume is not None:  # the loader goes on from the saved position by itself
        assert px.load_state(resume)
        done = px.global_step
    losses, seen = [], []
    for (batch,) in loader:  # (a batch taken from the loader counts as consumed by a checkpoint)
        seen.append(batch.clone())
        loss = px.forward_backward(model, _inputs(kind, batch), batch[:, 1:], lm_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(px.reduce(loss, "mean").item())
        if len(losses) == steps:
            if checkpoint is not None:
                px.save_state(checkpoint)  # inside the epoch: a resume goes on with its next batch
            break
    out = {
        "strategy": px.strategy_name,
        "plan": px.plan.describe(),
        "dp": (px.dp_rank, px.dp_size),
        "losses": losses,
        "seen": seen,
        "global_step": px.global_step,
        "state": {k: v.detach().clone().float() for k, v in px.get_state_dict(model).items()},
        "dtensors": sorted(n for n, p in px.unwrap_model(model).named_parameters() if hasattr(p, "device_mesh")),
        "placements": {
            n: [type(x).__name__ for x in p.placements]
            for n, p in px.unwrap_model(model).named_parameters()
            if hasattr(p, "placements")
        },
        "params": sorted(n for n, _ in px.unwrap_model(model).named_parameters()),
        # this rank's own part of each split parameter, and how it is split (each rank's, not rank 0's only)
        "local": {
            n: ([repr(pl) for pl in p.placements], p.to_local().detach().clone().float())
            for n, p in px.unwrap_model(model).named_parameters()
            if hasattr(p, "device_mesh")
        },
    }
    if px.rank == 0:
        out["reference"] = reference(kind, global_batch, done + len(losses), lr, start)
    return out


def matrix(cases: dict[str, dict]) -> dict[str, dict]:
    """Every case in order in this rank: one process group serves them all."""
    return {name: train(**kwargs) for name, kwargs in cases.items()}


def refusals() -> dict[str, str]:
    """What prepare says, on this rank, for models tensor parallel cannot split as asked."""
    from tests.dist.strategy_workloads import TinyNet

    out = {}
    for name, settings, model in (
        ("no plan", {"tp": 2}, TinyNet()),
        ("no match", {"tp": 2, "tp_plan": {"layers.*.attn.qq": "colwise"}}, TinyLM()),
    ):
        px = Phalanx(strategy="ddp", **settings)
        try:
            px.prepare(model)
        except ValueError as error:
            out[name] = str(error)
    return out
