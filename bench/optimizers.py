"""Muon beside AdamW in the layouts that split tensors: step time and bytes moved per step.

    python bench/optimizers.py [--world-size 2] [--rounds 5] [--steps 4] [--only ddp zero3 ...]

A stack of residual MLP blocks (Muon on the blocks' matrices, AdamW on the rest, as torch's Muon
asks; the AdamW run steps everything with AdamW), trained through px.forward_backward in each layout
(ddp, zero1, zero3, tp over all ranks), in one process group, the two optimizers alternating round
by round. Prints the median step time, the bytes each step sends summed over the ranks, their
Muon/AdamW ratios, and how many Newton-Schulz runs each rank made per step (phalanx gives each
matrix to one owner rank in the layouts that split tensors; ddp replicates the step on every rank,
as torch's own Muon under DDP does).

Bytes: what each process writes to its sockets (`wchar` of /proc/self/io, which gloo's TCP sends go
through; a few log lines are noise), so CPU/gloo only: on GPUs NCCL's traffic is not counted there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch import nn

from _spawn import in_process_group, spawn
from strategies import DIM, Block  # the residual MLP block of bench/strategies.py (BENCH_DIM)

BLOCKS, SEQ, BATCH = int(os.environ.get("BENCH_BLOCKS", 4)), 32, 16
TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero3": {"strategy": "zero3"},
    "tp": {"strategy": "ddp", "tp_plan": TP_PLAN},
}  # tp: over all ranks
NS_CALLS = [0]
_newton_schulz = torch_muon._zeropower_via_newtonschulz


def _counted(*args, **kwargs):
    NS_CALLS[0] += 1
    return _newton_schulz(*args, **kwargs)


torch_muon._zeropower_via_newtonschulz = _counted


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean((1, 2))


def _optimizers(model: nn.Module, which: str) -> list[torch.optim.Optimizer]:
    if which == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    chosen = {id(p) for p in matrices}
    return [
        torch.optim.Muon(matrices, lr=0.02),
        torch.optim.AdamW([p for p in model.parameters() if id(p) not in chosen], lr=1e-3),
    ]


def _sent() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _run(layout: str, which: str, steps: int) -> tuple[float, int, float]:
    """Median seconds per step (slowest rank), bytes sent per step over all ranks, NS runs per step
    on this rank."""
    from phalanx import Phalanx

    settings = dict(LAYOUTS[layout])
    if layout == "tp":
        settings["tp"] = dist.get_world_size()
    px = Phalanx(**settings)
    torch.manual_seed(0)
    model = Net()
    model, *opts = px.prepare(model, *_optimizers(model, which))
    x, y = torch.randn(BATCH // px.dp_size, SEQ, DIM), torch.randn(BATCH // px.dp_size)
    loss_fn = nn.functional.mse_loss
    times, sent = [], []
    for i in range(steps + 1):  # the first step gathers the owners' whole tensors: not timed
        dist.barrier()
        before, start = _sent(), time.perf_counter()
        ns_before = NS_CALLS[0]
        px.forward_backward(model, x, y, loss_fn)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        elapsed, moved = time.perf_counter() - start, _sent() - before
        if i:
            times.append(elapsed)
            sent.append(moved)
    result = torch.tensor([statistics.median(times), float(statistics.median(sent))], dtype=torch.float64)
    slowest = result.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(result, op=dist.ReduceOp.SUM)
    return slowest[0].item(), int(result[1].item()), float(NS_CALLS[0] - ns_before)


def bench(layouts: list[str], rounds: int, steps: int) -> None:
    rank = dist.get_rank()
    seconds = {(l, w): [] for l in layouts for w in ("adamw", "muon")}
    sent: dict[tuple[str, str], list[int]] = {k: [] for k in seconds}
    ns: dict[str, list[float]] = {l: [] for l in layouts}
    for _ in range(rounds):
        for layout in layouts:
            for which in ("adamw", "muon"):
                t, b, n = _run(layout, which, steps)
                seconds[layout, which].append(t)
                sent[layout, which].append(b)
                if which == "muon":
                    counts = [None] * dist.get_world_size()
                    dist.all_gather_object(counts, n)
                    ns[layout] = counts
    if rank:
        return
    matrices = 2 * BLOCKS
    print(
        f"\n{dist.get_world_size()} CPU processes (gloo), {BLOCKS} blocks of {DIM}x{4 * DIM} matrices "
        f"({matrices} for Muon), batch {BATCH}x{SEQ}; medians of {rounds} rounds x {steps} steps"
    )
    print(
        f"{'layout':8s} {'AdamW ms':>9s} {'Muon ms':>9s} {'time x':>7s} {'AdamW MiB':>10s} {'Muon MiB':>9s} "
        f"{'bytes x':>8s}  Newton-Schulz per step on each rank"
    )
    for layout in layouts:
        ta, tm = (statistics.median(seconds[layout, w]) for w in ("adamw", "muon"))
        ba, bm = (statistics.median(sent[layout, w]) for w in ("adamw", "muon"))
        per_rank = " ".join(f"{c:g}" for c in ns[layout])
        print(
            f"{layout:8s} {ta * 1e3:9.1f} {tm * 1e3:9.1f} {tm / ta:7.2f} {ba / 2**20:10.2f} {bm / 2**20:9.2f} "
            f"{bm / max(ba, 1):8.2f}  {per_rank} (of {matrices})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    os.environ.setdefault("PHALANX_RUN_DIR", tempfile.mkdtemp(prefix="phalanx-bench-"))  # not ./runs
    spawn(in_process_group, args.world_size, bench, args.only, args.rounds, args.steps)


if __name__ == "__main__":
    main()
