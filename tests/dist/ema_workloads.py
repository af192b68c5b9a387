"""Rank functions: torch's EMA idiom (`AveragedModel` + `get_ema_multi_avg_fn`, update after each
step) on the prepared model, compared with the same loop in one process, no phalanx."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from phalanx import Phalanx

STEPS, DECAY = 4, 0.9
X_EVAL = torch.linspace(-1, 1, 3 * 16).reshape(3, 16)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel) -> None:
    for step in range(STEPS):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def ema_in_layouts(layouts: list[dict]) -> dict:
    """For each layout: the EMA's weights (full tensors) and its output on a fixed input, with the
    max relative difference against one process; or the error the idiom raised."""
    reference = _mlp()
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=0.05), ref_ema)
    with torch.no_grad():
        expected_out = ref_ema(X_EVAL)
    expected = {k: v.detach() for k, v in ref_ema.module.state_dict().items()}
    results = {}
    for settings in layouts:
        name = "+".join(f"{k}={v}" for k, v in settings.items())
        px = Phalanx(**settings)
        model = _mlp()
        model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        try:
            ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
            _train(model, optimizer, ema)
            with torch.no_grad():
                out = _full(ema(X_EVAL))
            got = {k: _full(v) for k, v in ema.module.state_dict().items()}
        except Exception as e:  # the test reports which layout failed and how
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        got = {k.removeprefix("module."): v for k, v in got.items()}  # ddp: the EMA copies the DDP wrapper
        results[name] = {
            "plan": px.plan.describe(),
            "keys": sorted(got) == sorted(expected),
            "weights": max(((got[k] - v).norm() / v.norm()).item() for k, v in expected.items()),
            "output": ((out - expected_out).norm() / expected_out.norm()).item(),
        }
    return results


def refused_under(settings: dict) -> str:
    """The message `AveragedModel(model)` raises where the layout cannot be copied (zero3 x tp)."""
    px = Phalanx(**settings)
    model = px.prepare(_mlp())
    try:
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    except ValueError as e:
        return str(e)
    return ""
