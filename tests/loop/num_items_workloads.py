"""Variable-length, padded token sequences trained with `px.backward(loss, num_items=...)` on every
rank, and the one-process reference on the whole global batch (run in-process by the test)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import Phalanx

VOCAB, PAD, IGNORE = 11, 0, -100
NUM_SEQS, STEPS = 16, 2  # 2 optimizer steps of 8 sequences: 2 ranks x 2 micro-steps x 2 sequences


def make_sequences() -> list[torch.Tensor]:
    """Lengths from 1 to 12 tokens: per-micro-batch means weight them very unequally."""
    g = torch.Generator().manual_seed(3)
    lengths = [1, 12, 2, 11, 3, 1, 9, 2, 12, 1, 4, 10, 2, 7, 1, 12]
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths[:NUM_SEQS]]


def collate(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs padded with PAD; next-token labels with the padding (and each last token) at -100."""
    width = max(len(s) for s in seqs)
    inputs = torch.full((len(seqs), width), PAD)
    labels = torch.full((len(seqs), width), IGNORE)
    for i, s in enumerate(seqs):
        inputs[i, : len(s)] = s
        labels[i, : len(s) - 1] = s[1:]
    return inputs, labels


class TokenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(x))))


def summed_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(inputs)
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, (labels != IGNORE).sum()


def reference(skip_first: bool = False) -> dict:
    """One process, one batch of all 8 sequences per step: loss = Σ CE / Σ target tokens.
    `skip_first`: the first step's update is not applied (as fp16's scaler skips an overflowing step)."""
    model = TokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seqs = make_sequences()
    norms, losses = [], []
    for step in range(STEPS):
        inputs, labels = collate(seqs[8 * step : 8 * step + 8])
        loss, n = summed_loss(model, inputs, labels)
        (loss / n).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        losses.append((loss / n).item())
        if not (skip_first and step == 0):
            optimizer.step()
        optimizer.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms, "losses": losses}


def train(strategy: str, weighting: str = "num_items", mixed_precision: str = "no", clip: bool = True) -> dict:
    """2 micro-steps per optimizer step; `weighting` "num_items" (token-weighted over the global
    batch) or "mean" (each micro-batch's own mean: the usual, wrong, average)."""
    px = Phalanx(strategy=strategy, grad_accum_steps=2, mixed_precision=mixed_precision, seed=0)
    model = TokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(make_sequences(), batch_size=2, shuffle=False, collate_fn=collate)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    norms, losses = [], []
    for inputs, labels in loader:
        with px.accumulate(model):
            loss, n = summed_loss(model, inputs, labels)
            if weighting == "num_items":
                px.backward(loss, num_items=n)
            else:
                px.backward(loss / n.clamp(min=1))
            if clip:  # clipping must see the rescaled gradients: its norm is the global batch's
                norm = px.clip_grad_norm_(model.parameters(), max_norm=1e6)
                if norm is not None:
                    norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
            if px.sync_gradients and weighting == "num_items":
                losses.append(px.step_loss)
    state = px.get_state_dict(model)
    return {
        "state": {k: v.detach().clone() for k, v in state.items()},
        "norms": norms,
        "losses": losses,
        "global_step": px.global_step,
        "strategy": px.strategy_name,
    }


def matrix(cases: dict[str, dict]) -> dict:
    return {name: train(**kwargs) for name, kwargs in cases.items()}


def no_items_anywhere(zero_on: str) -> str:
    """Step 1 has target tokens; in step 2 every label is -100 on `zero_on` ranks ("all": every rank,
    so the step has nothing to average; "rank0": only rank 0, which is fine)."""
    px = Phalanx(strategy="ddp", seed=0)
    model = TokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = px.prepare(model, optimizer)
    inputs, labels = collate(make_sequences()[:2])
    try:
        for step in range(2):
            masked = step == 1 and (zero_on == "all" or px.rank == 0)
            target = torch.full_like(labels, IGNORE) if masked else labels
            loss, n = summed_loss(model, inputs, target)
            px.backward(loss, num_items=n)
            optimizer.step()
            optimizer.zero_grad()
    except ValueError as error:
        return str(error)
    return f"ok after {px.global_step} steps"


BAD_VALUES = {  # what rank 1 passes where rank 0 passes the real count, and in which step
    "None in the first step": (0, None),
    "None in a later step": (1, None),
    "negative": (1, -3),
    "a string": (0, "12"),
    "a tensor of 2": (1, torch.tensor([1, 2])),
}


def bad_num_items() -> dict[str, str]:
    """Each case: rank 1 passes a bad num_items; every rank must raise the same error (none may hang)."""
    out = {}
    for name, (step_of, value) in BAD_VALUES.items():
        px = Phalanx(strategy="ddp", seed=0)
        model = TokenLM()
        model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        inputs, labels = collate(make_sequences()[:2])
        try:
            for step in range(2):
                loss, n = summed_loss(model, inputs, labels)
                px.backward(loss, num_items=value if (px.rank == 1 and step == step_of) else n)
                optimizer.step()
                optimizer.zero_grad()
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    return out
