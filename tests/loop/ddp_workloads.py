"""Run on every rank by the DDP-options tests: comm hooks with save/resume, an unused branch."""

from __future__ import annotations

import torch
from torch import nn

from phalanx import Phalanx


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _steps(px: Phalanx, model, optimizer, n: int) -> list[float]:
    x, y = _batch(px.rank)
    losses = []
    for _ in range(n):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        px.backward(loss)
        optimizer.step()
        losses.append(px.reduce(loss.detach()).item())
    return losses


def _weights(px: Phalanx, model) -> dict:
    return {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}


def hook_resume(directory: str, hooks: list[str]) -> dict:
    """Per hook (`name` or `name@strategy`, default ddp): 8 steps in one go (saving after 4), and
    4 steps resumed from that save."""
    out = {}
    for spec in hooks:
        hook, _, strategy = spec.partition("@")
        kwargs = {
            "strategy": strategy or "ddp",
            "comm_hook": hook,
            "powersgd_rank": 1,
            "powersgd_start_iter": 2,
            "checkpoint_dir": f"{directory}/{hook}-{strategy}",
        }
        if hook in ("bf16", "powersgd"):  # several buckets (PowerSGD on gloo: one in flight at a time)
            kwargs["bucket_cap_mb"] = 0.01
        px = Phalanx(**kwargs)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = px.prepare(model, optimizer)
        losses = _steps(px, model, optimizer, 4)
        if strategy == "zero1":  # save_state cannot save a ZeroRedundancyOptimizer (not consolidated)
            losses += _steps(px, model, optimizer, 4)
            out[spec] = {
                "strategy": px.strategy_name,
                "losses": losses,
                "straight": _weights(px, model),
                "hook_name": type(model.phalanx_comm_hook_state).__name__,
            }
            continue
        px.save_state()
        losses += _steps(px, model, optimizer, 4)
        straight = _weights(px, model)
        error_norm, bucket_bytes, buckets = None, model.bucket_bytes_cap, None
        if hook == "powersgd":
            state = model.phalanx_comm_hook_state.powersgd
            error_norm = sum(float(e.norm()) for e in state.error_dict.values())
            buckets = len(model.phalanx_comm_hook_state.layout)

        resumed_px = Phalanx(**kwargs)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = resumed_px.prepare(model, optimizer)
        assert resumed_px.load_state() is True
        _steps(resumed_px, model, optimizer, 4)
        out[spec] = {
            "strategy": resumed_px.strategy_name,
            "losses": losses,
            "straight": straight,
            "resumed": _weights(resumed_px, model),
            "error_norm": error_norm,
            "bucket_bytes": bucket_bytes,
            "buckets": buckets,
            "hook_name": type(model.phalanx_comm_hook_state).__name__,
        }
    return out


class WithUnusedBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2)  # never in the forward

    def forward(self, x):
        return self.used(x)


def unused_branch(find_unused: bool) -> dict:
    px = Phalanx(strategy="ddp", find_unused_parameters=find_unused)
    torch.manual_seed(0)
    model = WithUnusedBranch()
    before = _weights(px, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)
    g = torch.Generator().manual_seed(px.rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        px.backward(loss)
        optimizer.step()
        losses.append(px.reduce(loss.detach()).item())
    return {
        "losses": losses,
        "before": before,
        "after": _weights(px, model),
        "find_unused": model.find_unused_parameters,
    }
