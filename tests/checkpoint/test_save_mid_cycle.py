"""`px.save_state()` in the middle of a gradient-accumulation cycle: the checkpoint is written after
the cycle's optimizer step (it dropped the accumulated gradient: losses after a resume differed by
up to 50 %), and a resume from it ends where the uninterrupted run does."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx


def _run(tmp_path, save_at: int | None = None, resume: bool = False):
    px = Phalanx(grad_accum_steps=2, checkpoint_dir=tmp_path / "ckpt", seed=0)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g))
    model, opt, loader = px.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4, shuffle=True)
    )
    if resume:
        assert px.load_state()
    saved = None
    for i, (x, y) in enumerate(loader):
        with px.accumulate(model):
            px.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if i == save_at:  # micro-step 1 of the cycle of batches 2 and 3
            with pytest.warns(UserWarning, match=r"save_state\(\) at micro-step 1 of an accumulation cycle of 2"):
                saved = px.save_state()
    return px, model, saved


def test_a_save_mid_cycle_is_written_after_the_cycle_and_resumes_exactly(tmp_path):
    _, reference, _ = _run(tmp_path / "ref")
    px, _, saved = _run(tmp_path, save_at=2)
    assert saved.endswith("step-00000002") and (tmp_path / "ckpt" / "step-00000002").is_dir()
    assert not (tmp_path / "ckpt" / "step-00000001").exists()
    again, resumed, _ = _run(tmp_path, resume=True)
    assert again.global_step == 4
    torch.testing.assert_close(resumed.weight, reference.weight, rtol=0, atol=0)
    torch.testing.assert_close(resumed.bias, reference.bias, rtol=0, atol=0)
