"""An unmodified Lightning Fabric training script, as Fabric's docs write one for `fabric run` (no
`fabric.launch()`: the CLI made the processes): it must run under `phalanx run` as one world."""

import json
import sys

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

fabric = Fabric()  # devices, accelerator and precision from the launcher, as `fabric run` hands them
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4))
steps = 0
for x, y in loader:
    optimizer.zero_grad()
    fabric.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    steps += 1
weights = fabric.all_gather(model.weight.detach().reshape(1, -1))
if fabric.is_global_zero:
    with open(sys.argv[1], "w") as f:
        json.dump(
            {
                "world_size": fabric.world_size,
                "steps": steps,
                "precision": str(fabric._precision.precision),
                "ranks_agree": bool(torch.equal(weights[0], weights[-1])),
            },
            f,
        )
