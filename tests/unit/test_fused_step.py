"""What every data-parallel layout does to the script's optimizer beyond wrapping the model: torch's fused Adam/AdamW CPU
kernel where the script left the choice to torch (strategies/optimizers/fused_step.py), and no import of
torch.distributed.optim to recognise a ZeroRedundancyOptimizer (its TorchScript compilation held
3.2 MiB for good)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from phalanx.strategies.optimizers import fused_step


def _steps(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_an_unset_kernel_steps_fused_within_fp32_rounding_of_torchs_loop(kind):
    plain, fused = _model(), _model()
    reference = kind(plain.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = kind(fused.parameters(), lr=1e-2, weight_decay=0.1)
    fused_step.prefer_fused(optimizer)
    assert [g["fused"] for g in optimizer.param_groups] == [True]
    torch.testing.assert_close(_steps(optimizer, fused), _steps(reference, plain), rtol=1e-6, atol=1e-6)


def test_the_scripts_own_choice_and_other_optimizers_are_kept():
    model = _model()
    for explicit in ({"foreach": False}, {"foreach": True}, {"fused": False}, {"differentiable": True}):
        optimizer = torch.optim.AdamW(model.parameters(), **explicit)
        fused_step.prefer_fused(optimizer)
        assert optimizer.param_groups[0]["fused"] in (None, False), explicit

    class MyAdamW(torch.optim.AdamW):  # a subclass may step otherwise
        pass

    for optimizer in (MyAdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)):
        fused_step.prefer_fused(optimizer)
        assert not optimizer.param_groups[0].get("fused"), type(optimizer).__name__
    mixed = torch.optim.AdamW(
        [{"params": list(model.parameters())}, {"params": [nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))]}]
    )
    fused_step.prefer_fused(mixed)
    assert [g["fused"] for g in mixed.param_groups] == [True, None]  # fused CPU takes no complex tensors


def test_recognising_a_zero_redundancy_optimizer_imports_no_torch_distributed_optim():
    code = (
        "import sys, torch\n"
        "from phalanx.strategies.strategy import _is_zero_redundancy\n"
        "assert not _is_zero_redundancy(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))\n"
        "assert 'torch.distributed.optim' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
