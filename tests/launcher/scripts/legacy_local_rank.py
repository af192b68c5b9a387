"""A torch.distributed.launch-era script: argparse requires --local_rank."""

import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

px = Phalanx()
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.arange(8.0).unsqueeze(1), torch.arange(8.0).unsqueeze(1))
model, optimizer, loader = px.prepare(model, optimizer, DataLoader(data, batch_size=2))
seen = []
for x, y in loader:
    seen += x.squeeze(1).tolist()
    optimizer.zero_grad()
    px.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
with open(os.path.join(args.out, f"rank{px.rank}.json"), "w") as fp:
    json.dump(
        {
            "local_rank_arg": args.local_rank,
            "local_rank": px.local_rank,
            "world_size": px.world_size,
            "seen": seen,
            "weight": px.unwrap_model(model).weight.item(),
        },
        fp,
    )
px.print(f"trained on {px.world_size} ranks")
