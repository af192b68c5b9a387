"""A small DDP job for the observe tests: `--straggler data` makes rank 1's loader sleep DELAY ms per
batch, `--straggler forward` makes rank 1's forward take DELAY ms longer; `--until FILE` keeps
training (one epoch after another, up to --steps) until FILE exists."""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--straggler", choices=("none", "data", "forward"), default="none")
parser.add_argument("--delay-ms", type=float, default=40.0)
parser.add_argument("--until", default=None)
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--forward-backward", action="store_true")  # px.forward_backward instead of the hand loop
parser.add_argument("--stall-at", type=int, default=None)  # rank 1 stops there, on the first attempt only
parser.add_argument("--step-sleep-ms", type=float, default=0.0)  # every rank: a slower, steadier job
args = parser.parse_args()
slow = int(os.environ.get("RANK", "0")) == 1
delay = args.delay_ms / 1000


def collate(items):
    if slow and args.straggler == "data":
        time.sleep(delay)
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        if slow and args.straggler == "forward":
            time.sleep(delay)
        return self.body(x)


torch.manual_seed(0)
px = Phalanx(strategy=args.strategy, seed=0)
data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
net = Net()
model, opt, loader = px.prepare(
    net, torch.optim.SGD(net.parameters(), lr=0.01), DataLoader(data, batch_size=4, collate_fn=collate)
)


def told_to_stop(step):
    """Every 20 steps, all ranks agree whether the --until file exists (the same step on every rank)."""
    if not args.until or step % 20:
        return False
    return bool(px.reduce(torch.tensor(float(os.path.exists(args.until))), "max").item())


step, stopping = 0, False
while step < args.steps and not stopping:
    for x, y in loader:
        if args.forward_backward:
            loss = px.forward_backward(model, x, y, nn.functional.mse_loss)
        else:
            loss = nn.functional.mse_loss(model(x), y)
            px.backward(loss)
        opt.step()
        opt.zero_grad()
        if args.step_sleep_ms:
            with px.busy("sleep"):
                time.sleep(args.step_sleep_ms / 1000)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if slow and step == args.stall_at and first_attempt:
            time.sleep(600)  # the watchdog stops the job long before
        if step % 10 == 0:
            px.log({"loss": loss.item()}, step=step)
        step += 1
        stopping = told_to_stop(step)
        if step >= args.steps or stopping:
            break
