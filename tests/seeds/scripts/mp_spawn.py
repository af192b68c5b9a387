"""Seed 004's mp.spawn trainer (ddp_setup, a DistributedSampler, DDP(model) replaced by
`Phalanx()` after its own init_process_group, which phalanx adopts, and `px.prepare`). The master
port comes from the command line here (the seed fixes 12355; tests need a free one).

    phalanx run --nproc-per-node 1 [--strategy zero3] mp_spawn.py OUT_DIR PORT
"""

import os
import sys

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from seed_data import SimpleNN, datasets, report
from phalanx import Phalanx


def ddp_setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset)
    )


def main(rank, world_size, total_epochs, batch_size, out_dir, port):
    ddp_setup(rank, world_size, port)
    px = Phalanx()  # adopts the group above
    dataset, _ = datasets()
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, train_data = px.prepare(model, optimizer, prepare_dataloader(dataset, batch_size))
    seen = []
    for epoch in range(total_epochs):
        train_data.sampler.set_epoch(epoch)
        mine = []
        for source, targets, ids in train_data:
            optimizer.zero_grad()
            px.backward(F.cross_entropy(model(source), targets))
            optimizer.step()
            mine += ids.tolist()
        seen.append(mine)
    report(out_dir, "mp_spawn", px.rank, seen=seen, world_size=px.world_size, strategy=px.strategy_name)
    destroy_process_group()


if __name__ == "__main__":
    world_size = 2  # seed: torch.cuda.device_count()
    mp.spawn(main, args=(world_size, 2, 4, sys.argv[1], sys.argv[2]), nprocs=world_size)
