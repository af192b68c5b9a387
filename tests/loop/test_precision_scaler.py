"""fp16: torch's ShardedGradScaler for sharded strategies, torch's GradScaler otherwise, no private state."""

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from phalanx.loop.precision import Precision


def test_sharded_strategies_get_torchs_sharded_scaler():
    # torch's, with an unscale that takes tensor parallel's DTensor and plain gradients apart
    assert isinstance(Precision("fp16", torch.device("cpu"), sharded=True).scaler, ShardedGradScaler)
    assert type(Precision("fp16", torch.device("cpu")).scaler) is torch.amp.GradScaler
    assert Precision("bf16", torch.device("cpu"), sharded=True).scaler is None


def test_unscale_once_per_step_then_step_and_update():
    precision = Precision("fp16", torch.device("cpu"))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    for _ in range(2):  # twice: after update() the next step may unscale again
        precision.backward(model(torch.ones(2, 3)).sum())
        precision.unscale_(optimizer)
        grad = model.weight.grad.clone()
        precision.unscale_(optimizer)  # clipping then stepping: unscaled once, not twice
        assert torch.equal(model.weight.grad, grad)
        precision.step(optimizer)
        optimizer.zero_grad()
    assert torch.equal(grad, torch.full_like(grad, 2.0))  # the true gradient of sum over 2 rows of ones
    assert not torch.equal(model.weight, before)
