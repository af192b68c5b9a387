"""Seed 002's single-machine recipe: torch.nn.DataParallel, no process group at all.

phalanx run --nproc-per-node 2 data_parallel.py OUT_DIR
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from seed_data import SimpleNN, datasets, report

train_dataset, _ = datasets()
train_loader = DataLoader(train_dataset, batch_size=32, shuffle=True)
model = torch.nn.DataParallel(SimpleNN())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
seen = []
for inputs, targets, ids in train_loader:
    outputs = model(inputs)
    loss = F.cross_entropy(outputs, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    seen += ids.tolist()
report(sys.argv[1], "data_parallel", int(os.environ["RANK"]), seen=[seen])
