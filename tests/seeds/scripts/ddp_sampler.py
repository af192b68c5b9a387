"""Seed 003's DDP script (the DistributedSampler loop of seeds 002 and 004 too), moved onto phalanx
as the migration guide shows: `dist.init_process_group` and `DDP(model)` become `Phalanx()` and
`px.prepare`; the DistributedSampler, `set_epoch`, `dist.all_reduce` of loss and accuracy and the
rank-0 `model.module` save stay as the seed wrote them.

    phalanx run --nproc-per-node 2 [--strategy zero3 | --tp 2] ddp_sampler.py OUT_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from seed_data import SimpleNN, datasets, report
from phalanx import Phalanx

out_dir = sys.argv[1]
px = Phalanx()  # was: dist.init_process_group(backend="nccl")
torch.manual_seed(0)


def prepare_dataloader():
    trainset, validset = datasets()
    trainloader = DataLoader(trainset, batch_size=4, sampler=DistributedSampler(trainset))
    validloader = DataLoader(validset, batch_size=8, sampler=DistributedSampler(validset))
    return trainloader, validloader


def evaluate(model, validloader):
    model.eval()
    acc_num = torch.zeros(())
    gathered = []
    with torch.inference_mode():
        for x, y, ids in validloader:
            pred = torch.argmax(model(x), dim=-1)
            acc_num += (pred.long() == y.long()).float().sum()
            gathered += px.gather_for_metrics(ids).tolist()
    dist.all_reduce(acc_num)
    return (acc_num / len(validloader.dataset)).item(), gathered


def train(model, optimizer, trainloader, validloader, epoch=2):
    seen, accs = [], []
    for ep in range(epoch):
        model.train()
        trainloader.sampler.set_epoch(ep)  # seed 003's spelling; seed 002 calls train_sampler.set_epoch(ep)
        mine = []
        for x, y, ids in trainloader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            px.backward(loss)  # was: loss.backward()
            optimizer.step()
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            mine += ids.tolist()
        seen.append(mine)
        acc, gathered = evaluate(model, validloader)
        accs.append(acc)
        if int(os.environ["RANK"]) == 0:
            print(f"ep: {ep}, acc: {acc}")
    return seen, accs, gathered


trainloader, validloader = prepare_dataloader()
model = SimpleNN()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model, optimizer, trainloader, validloader = px.prepare(model, optimizer, trainloader, validloader)
seen, accs, gathered = train(model, optimizer, trainloader, validloader)

saved = module_error = None
try:  # the seeds' save, on rank 0
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), os.path.join(out_dir, "model.pt"))
        saved = "model.pt"
except AttributeError as error:
    module_error = str(error)
full = px.get_state_dict(model)
if px.is_main_process:
    torch.save(full, os.path.join(out_dir, "full.pt"))
report(
    out_dir,
    "ddp_sampler",
    px.rank,
    seen=seen,
    accs=accs,
    gathered=gathered,
    saved=saved,
    module_error=module_error,
    dp_rank=px.dp_rank,
    dp_size=px.dp_size,
)
