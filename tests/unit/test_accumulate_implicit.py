"""grad_accum_steps from a config file with a script that never calls px.accumulate: each backward
is a micro-step, and the result equals the explicit `with px.accumulate(model):` loop."""

import torch

from phalanx import Phalanx


def _train(explicit: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    px = Phalanx(grad_accum_steps=3, watchdog_timeout=0)
    model, optimizer = px.prepare(model, optimizer)
    data = torch.randn(12, 4)
    steps = 0
    for i in range(0, 12, 2):

        def micro_step(i=i):
            loss = model(data[i : i + 2]).pow(2).mean()
            px.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

        if explicit:
            with px.accumulate(model):
                micro_step()
        else:
            micro_step()
        steps += px.sync_gradients
    assert steps == 2  # 6 micro-steps, accumulation 3
    return [p.detach().clone() for p in model.parameters()]


def test_backward_outside_accumulate_counts_micro_steps():
    for implicit, explicit in zip(_train(False), _train(True)):
        torch.testing.assert_close(implicit, explicit, rtol=0, atol=0)
