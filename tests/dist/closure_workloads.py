"""Optimizers whose step calls the closure and reads its loss (LBFGS with a strong-Wolfe line search,
a user's optimizer that does the same), trained as torch's docs write LBFGS, under ddp: each rank
its half of the global batch; rank 0 also runs the one-process reference on the whole batch."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from phalanx import Phalanx

GLOBAL_BATCH = 16


class LossReadingSGD(torch.optim.Optimizer):
    """A user's optimizer (undeclared) that calls the closure twice and takes a step only when the
    loss allows it: replicas that read their own loss would part."""

    def __init__(self, params: Any, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        assert closure is not None
        with torch.enable_grad():
            loss = closure()
        lr = self.param_groups[0]["lr"] * (1.0 if float(loss) > 0.5 else 0.5)  # reads the loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=lr)
        if float(loss) > 0.2:  # a second evaluation only some losses ask for
            with torch.enable_grad():
                closure()
        return loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)


def _optimizer(which: str, model: nn.Module, max_iter: int) -> torch.optim.Optimizer:
    if which == "lbfgs":
        return torch.optim.LBFGS(model.parameters(), lr=1, max_iter=max_iter, line_search_fn="strong_wolfe")
    return LossReadingSGD(model.parameters())


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[float]:
    """The loop as torch's docs write LBFGS."""
    loss_fn = nn.MSELoss()
    losses = []
    for _ in range(steps):

        def closure():
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure)))
    return losses


def train(which: str, steps: int = 3, max_iter: int = 5, **settings: Any) -> dict[str, Any]:
    """`max_iter`: LBFGS's closure evaluations per step at most (torch's default is 20)."""
    settings.setdefault("strategy", "ddp")
    px = Phalanx(**settings)
    x, y = _data()
    half = GLOBAL_BATCH // px.dp_size
    mine = slice(px.rank * half, (px.rank + 1) * half)
    model = _model()
    model, optimizer = px.prepare(model, _optimizer(which, model, max_iter))
    losses = _train(model, optimizer, x[mine], y[mine], steps)
    out = {"losses": losses, "state": {k: v.detach().clone() for k, v in px.unwrap_model(model).state_dict().items()}}
    if px.rank == 0:
        reference = _model()
        out["reference"] = {
            "losses": _train(reference, _optimizer(which, reference, max_iter), x, y, steps),
            "state": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        }
    return out
