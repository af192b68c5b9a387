"""The seeds' data, small: 64 training and 50 validation rows, each carrying its id so a test can
count who read what. Shared by the seed-style scripts beside it."""

import json
import os

import torch
from torch.utils.data import TensorDataset

NUM_TRAIN, NUM_VALID = 64, 50


def datasets():
    g = torch.Generator().manual_seed(42)
    x = torch.randn(NUM_TRAIN + NUM_VALID, 13, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    ids = torch.arange(NUM_TRAIN + NUM_VALID)
    return (
        TensorDataset(x[:NUM_TRAIN], y[:NUM_TRAIN], ids[:NUM_TRAIN]),
        TensorDataset(x[NUM_TRAIN:], y[NUM_TRAIN:], ids[NUM_TRAIN:] - NUM_TRAIN),
    )


class SimpleNN(torch.nn.Module):
    """Seed 004's wine classifier: 13 -> 64 -> 3."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 64)
        self.fc2 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def report(out_dir, name, rank, **facts):
    """What this rank saw, for the test: OUT_DIR/NAME-rankR.json."""
    with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as fp:
        json.dump(facts, fp)
