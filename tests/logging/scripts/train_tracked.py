"""A short training run for the tracker and profiler tests: 8 optimizer steps of a tiny model,
`px.log` of known values every step, hyper-parameters through `px.log_hyperparams`."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

STEPS = 8

px = Phalanx()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(STEPS * 2 * 4, 4), torch.randn(STEPS * 2 * 4, 1))
model, optimizer, loader = px.prepare(model, optimizer, DataLoader(data, batch_size=4))
px.log_hyperparams({"lr": 0.1, "batch_size": 4})
for step, (x, y) in enumerate(loader):
    with torch.profiler.record_function(f"user_step_{step}"):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        px.backward(loss)
        optimizer.step()
    px.log({"value": step / 4, "loss": px.reduce(loss.detach()).item()}, step=step)
print(f"rank {px.rank} done after {px.global_step} steps, run dir {px.run_dir}", flush=True)
