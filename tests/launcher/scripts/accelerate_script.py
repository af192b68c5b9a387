"""An unmodified HuggingFace Accelerate training script: it must run under `phalanx run`."""

import json
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
steps = 0
for x, y in loader:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    steps += 1
weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
if accelerator.is_main_process:
    with open(sys.argv[1], "w") as f:
        json.dump(
            {
                "num_processes": accelerator.num_processes,
                "steps": steps,
                "ranks_agree": bool(torch.equal(weights[0], weights[1])),
            },
            f,
        )
