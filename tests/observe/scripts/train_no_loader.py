"""A loop no prepared loader feeds, as many scripts write it: `px.prepare(model, optimizer)` and
the batches made in the loop. `--steps N` optimizer steps; every rank its own random batch."""

import argparse
import os

import torch
from torch import nn

from phalanx import Phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

torch.manual_seed(0)
px = Phalanx(strategy="ddp", seed=0)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model, optimizer = px.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
for _ in range(args.steps):
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
