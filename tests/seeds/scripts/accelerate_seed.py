"""Seed 003's Accelerate version: `Accelerator()` (no cpu=True), samplers replaced by shuffle,
`accelerator.prepare`, `accelerator.reduce` of the loss and `gather_for_metrics` for accuracy.

    phalanx run --nproc-per-node 2 [--mixed-precision bf16] accelerate_seed.py OUT_DIR
"""

import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from seed_data import SimpleNN, datasets, report


def main(out_dir):
    accelerator = Accelerator()
    trainset, validset = datasets()
    trainloader = DataLoader(trainset, batch_size=4, shuffle=True)
    validloader = DataLoader(validset, batch_size=8, shuffle=False)
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, trainloader, validloader = accelerator.prepare(model, optimizer, trainloader, validloader)
    seen = []
    for _ep in range(2):
        model.train()
        mine = []
        for x, y, ids in trainloader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            loss = accelerator.reduce(loss, "mean")
            mine += ids.tolist()
        seen.append(mine)
    model.eval()
    gathered = []
    with torch.inference_mode():
        for _x, _y, ids in validloader:
            gathered += accelerator.gather_for_metrics(ids).tolist()
    accelerator.print(f"num_processes {accelerator.num_processes}")
    report(
        out_dir,
        "accelerate_seed",
        int(os.environ["RANK"]),
        seen=seen,
        gathered=gathered,
        num_processes=accelerator.num_processes,
        is_main=accelerator.is_main_process,
        mixed_precision=accelerator.mixed_precision,
        distributed_type=str(accelerator.distributed_type),
    )


if __name__ == "__main__":
    main(sys.argv[1])
