"""Rank functions for tests/dist/test_sharded_embedding.py: embeddings looked up where their rows live."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx import Phalanx

PAD = 1


class Tagger(nn.Module):
    """An embedding with a padding row at the root, two blocks (the sharding units), a head."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, 8, padding_idx=PAD)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h.mean(1))


def batches(vocab: int, seq_by_rank: tuple[int, int], steps: int = 3) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per rank: (tokens, labels); ranks may have different sequence lengths (dynamic
    padding), and every batch holds padding tokens."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        step = []
        for seq in seq_by_rank:
            tokens = torch.randint(0, vocab, (2, seq), generator=g)
            tokens[:, -1] = PAD
            step.append((tokens, torch.randint(0, 3, (2,), generator=g)))
        out.append(step)
    return out


def train(px: Phalanx, vocab: int, seq_by_rank: tuple[int, int]) -> tuple[nn.Module, list[str], list[float]]:
    torch.manual_seed(0)
    model = Tagger(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = px.prepare(model, optimizer)
    exchanges, losses = [], []
    for step in batches(vocab, seq_by_rank):
        tokens, labels = step[px.rank]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), labels)
        px.backward(loss)
        optimizer.step()
        exchanges.append(getattr(model.embed, "phalanx_exchange", None))
        losses.append(px.reduce(loss.detach()).item())
    return model, exchanges, losses


def exchanges(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("zero3", "zero2"):
        for vocab, seqs in ((101, (3, 5)), (5, (4, 4))):  # rows (2 x 10 < 101); table (2 x 8 >= 5), uneven rows
            for exchange in ("auto", "params"):
                px = Phalanx(strategy=strategy, embedding_exchange=exchange)
                model, used, losses = train(px, vocab, seqs)
                out[(strategy, vocab, exchange)] = {
                    "class": type(model.embed).__name__,
                    "used": used,
                    "losses": losses,
                    "local_rows": model.embed.weight.to_local().shape[0],
                    "state": px.get_state_dict(model),
                }
    # A checkpoint saved with the table looked up resumes with it gathered by FSDP2, and back.
    saved = Phalanx(strategy="zero3", checkpoint_dir=directory)
    model, _, _ = train(saved, 101, (3, 5))
    saved.save_state()
    expected = saved.get_state_dict(model)
    resumed = Phalanx(strategy="zero3", embedding_exchange="params", checkpoint_dir=directory)
    torch.manual_seed(1)
    other = resumed.prepare(
        Tagger(101),
    )
    out["resumed_loaded"] = resumed.load_state()
    got = resumed.get_state_dict(other)
    out["resumed_equal"] = None if not got else all(torch.equal(got[k], expected[k]) for k in expected)
    # An id outside the table on one rank: every rank raises, naming it; none waits.
    px = Phalanx(strategy="zero3")
    model = px.prepare(Tagger(101))
    tokens = torch.tensor([[3, 4]]) if px.rank == 0 else torch.tensor([[3, 101]])
    try:
        model(tokens)
        out["out_of_range"] = None
    except IndexError as error:
        out["out_of_range"] = str(error)
    return out
