"""Lightning Fabric's documented form, what `python train.py` runs: devices and strategy in the code,
then `fabric.launch()` (torchrun runs it as one world; `fabric run` refuses the launch call)."""

import json
import sys

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4))
losses = []
for x, y in loader:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
if fabric.is_global_zero:
    with open(sys.argv[1], "w") as f:
        json.dump({"world_size": fabric.world_size, "losses": losses, "weight": model.weight.tolist()}, f)
