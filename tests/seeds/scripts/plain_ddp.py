"""Seed 004's multi-process trainer as written for torchrun: its own init_process_group, DDP and
DistributedSampler, no phalanx inside (gloo here: these machines have no GPU).

    phalanx run --nproc-per-node 2 plain_ddp.py OUT_DIR
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from seed_data import SimpleNN, datasets, report


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.seen = []

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        mine = []
        for source, targets, ids in self.train_data:
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(source), targets).backward()
            self.optimizer.step()
            mine += ids.tolist()
        self.seen.append(mine)

    def train(self, max_epochs):
        self.model.train()
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main(out_dir):
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset, _ = datasets()
    train_data = DataLoader(dataset, batch_size=4, shuffle=False, sampler=DistributedSampler(dataset))
    model = SimpleNN()
    trainer = Trainer(model, train_data, torch.optim.Adam(model.parameters(), lr=1e-3))
    trainer.train(2)
    report(out_dir, "plain_ddp", int(os.environ["RANK"]), seen=trainer.seen)
    destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
