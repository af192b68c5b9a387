"""LR schedulers step with the optimizer; an epoch's last partial accumulation cycle is flushed."""

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.loop.loop_workloads import scheduled_training


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,strategy", [("step", "ddp"), ("onecycle", "zero1")])
def test_two_ranks_with_accumulation_equal_one_process_with_the_global_batch(kind, strategy):
    # 40 samples, 2 ranks x batch 2 = 10 batches per rank; accumulation 4: cycles of 4, 4, 2 per epoch.
    ranks = run_ranks(
        "tests.loop.loop_workloads:scheduled_training", world_size=2, args=(2, 4, kind, 2, 40, strategy), timeout=240
    )
    reference = scheduled_training(16, 1, kind)  # one process, batches of 16, 16, 8
    assert reference["global_step"] == 6
    for r in ranks:
        assert r["strategy"] == strategy  # zero1: the scheduler was rebound to ZeroRedundancyOptimizer
        assert r["batches"] == 20
        assert r["global_step"] == 6  # 3 per epoch: the 2-batch remainder is flushed
        assert r["last_epoch"] == 6
        assert r["lrs"] == pytest.approx(reference["lrs"], rel=1e-12)
        for key, value in reference["state"].items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-6)
    assert len(set(ranks[0]["lrs"])) > 1  # the schedule really moved


def test_drop_discards_the_last_partial_cycle():
    # One process, 10 batches of 4, accumulation 4: 2 steps per epoch, the last 2 batches unused...
    dropped = scheduled_training(4, 4, "step", n=40, remainder="drop")
    assert dropped["global_step"] == 4 and dropped["last_epoch"] == 4
    # ...and their gradients do not leak into the next epoch's first step: the same as training on
    # batches of 16 with the 8-sample tail dropped (the same shuffled order).
    reference = scheduled_training(16, 1, "step", n=40, remainder="drop")
    assert reference["global_step"] == 6  # without accumulation nothing is partial: 16, 16, 8
    flushed = scheduled_training(4, 4, "step", n=40)
    assert flushed["global_step"] == 6
    for key, value in reference["state"].items():
        torch.testing.assert_close(flushed["state"][key], value, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(dropped["state"][key], value)


def test_scheduler_skips_when_fp16_skips_the_step():
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from phalanx import Phalanx

    px = Phalanx(mixed_precision="fp16")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    model, optimizer, loader, scheduler = px.prepare(model, optimizer, loader, scheduler)
    stepped = []
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        px.backward(loss * float("inf") if i == 0 else loss)  # inf gradients: the scaler skips the step
        optimizer.step()
        stepped.append(scheduler.step())
    assert stepped == [False, True]
    assert scheduler.last_epoch == 1 and px.global_step == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def _scheduled(tmp_path):
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from phalanx import Phalanx

    px = Phalanx(grad_accum_steps=2, checkpoint_dir=str(tmp_path))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,))), batch_size=2)
    return px, *px.prepare(model, optimizer, loader, scheduler)


def test_scheduler_state_and_a_pending_step_survive_a_checkpoint(tmp_path):
    from torch import nn

    px, model, optimizer, loader, scheduler = _scheduled(tmp_path)
    for i, (x, y) in enumerate(loader):
        with px.accumulate(model):
            px.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            if i == 5:  # the optimizer stepped, the scheduler not yet: saved in between
                px.save_state()
            else:
                scheduler.step()
            optimizer.zero_grad()
    assert scheduler.last_epoch == 2 and px.global_step == 3

    px2, model2, optimizer2, loader2, scheduler2 = _scheduled(tmp_path)
    assert px2.load_state() is True
    assert scheduler2.last_epoch == 2 and optimizer2.param_groups[0]["lr"] == 0.25
    assert scheduler2.step() is True  # the step still owed to the optimizer's third step
    assert scheduler2.last_epoch == 3 and optimizer2.param_groups[0]["lr"] == 0.125
    assert scheduler2.step() is False  # nothing more owed
