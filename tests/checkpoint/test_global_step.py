"""`px.global_step` counts real optimizer steps, also through an optimizer wrapper that skips some."""

import torch
from torch import nn

from phalanx import Phalanx


class EverySecondStep(torch.optim.Optimizer):
    """A wrapper like gradient accumulation's: an Optimizer itself, stepping the inner one every 2nd call."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer.param_groups, {})
        self.optimizer, self.calls = optimizer, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls % 2 == 0:
            self.optimizer.step(closure)


def test_global_step_counts_the_steps_the_inner_optimizer_took(tmp_path):
    px = Phalanx(checkpoint_dir=tmp_path)
    model = nn.Linear(3, 1)
    optimizer = px.prepare_optimizer(EverySecondStep(torch.optim.SGD(model.parameters(), lr=0.1)), model)
    px.prepare_model(model)
    for _ in range(7):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
    assert px.global_step == 3
    assert px.save_state().endswith("step-00000003")
    again = Phalanx(checkpoint_dir=tmp_path)
    model2 = again.prepare_model(nn.Linear(3, 1))
    again.prepare_optimizer(EverySecondStep(torch.optim.SGD(model2.parameters(), lr=0.1)), model2)
    assert again.load_state() and again.global_step == 3
    assert torch.equal(model2.weight, model.weight)


def test_saving_an_optimizer_without_state_does_not_count_a_step(tmp_path):
    """torch creates a stateless optimizer's state (plain SGD) with a zero-lr step() when saving or
    loading: that is no training step (it moved global_step: saving every 2 steps read 1, 3, 4, 6...)."""
    px = Phalanx(checkpoint_dir=tmp_path, checkpoint_keep=0)
    model = nn.Linear(3, 1)
    model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen, names = [], []
    for _ in range(6):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()  # no gradients at the save: torch steps at lr 0 to create the state
        if px.global_step % 2 == 0:
            names.append(px.save_state().rsplit("-", 1)[1])
        seen.append(px.global_step)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert names == ["00000002", "00000004", "00000006"]
    again = Phalanx(checkpoint_dir=tmp_path)
    model2 = nn.Linear(3, 1)
    model2, _ = again.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    assert again.load_state() and again.global_step == 6
