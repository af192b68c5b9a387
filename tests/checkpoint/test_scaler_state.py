"""fp16's gradient scaler (held by the strategy, not the user) is saved and restored with the rest."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx


def _prepared(px: Phalanx):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    return px.prepare(model, optimizer, loader)


def test_fp16_loss_scale_survives_save_and_load(tmp_path):
    px = Phalanx(mixed_precision="fp16", checkpoint_dir=str(tmp_path))
    model, optimizer, loader = _prepared(px)
    for x, y in loader:
        optimizer.zero_grad()
        with px.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        px.backward(loss)
        optimizer.step()
    scaler = px.strategy.precision.scaler
    scaler.update(new_scale=1234.0)
    px.save_state()

    resumed = Phalanx(mixed_precision="fp16", checkpoint_dir=str(tmp_path))
    _prepared(resumed)
    assert resumed.strategy.precision.scaler.get_scale() != 1234.0
    assert resumed.load_state() is True
    assert resumed.strategy.precision.scaler.get_scale() == 1234.0
    assert resumed.global_step == 2
