"""A small training script for `phalanx parity`: correct by default; `--bug loss` multiplies the loss by
the world size, `--batchnorm` puts BatchNorm in the model, `--stop-after M` ends after M steps,
`--no-backward` never trains, `--batch-from-dp-size` sets the per-process batch from a global 8 // px.dp_size."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["none", "loss"], default="none")
parser.add_argument("--batchnorm", action="store_true")
parser.add_argument("--stop-after", type=int, default=None)
parser.add_argument("--no-backward", action="store_true")
parser.add_argument("--batch-from-dp-size", action="store_true")
args = parser.parse_args()

px = Phalanx(seed=0)
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, generator=g) * 3 + 1
y = (x.sum(1) > 3).long()
layers = (
    [nn.Linear(6, 16)]
    + ([nn.BatchNorm1d(16)] if args.batchnorm else [])
    + [nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)]
)
model = nn.Sequential(*layers)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(x, y), batch_size=8 // px.dp_size if args.batch_from_dp_size else 4, shuffle=True)
model, optimizer, loader = px.prepare(model, optimizer, loader)
for step, (inputs, targets) in enumerate(loader):
    if args.stop_after is not None and step == args.stop_after:
        break
    loss = nn.functional.cross_entropy(model(inputs), targets)
    if args.no_backward:
        continue
    if args.bug == "loss":
        loss = loss * px.world_size
    px.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
px.print("done")
