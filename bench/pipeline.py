"""Pipeline parallel on CPU/gloo: torch's schedules side by side with DDP on the same global batch.

    python bench/pipeline.py [--rounds 5] [--steps 4] [--blocks 8]

2 ranks. DDP: each rank the whole model and half the batch. pp2: each rank half the blocks and
the whole batch, cut into microbatches (strategies/pipeline, the model's forward unchanged). Prints
median steps/s, the ratio to DDP (alternating rounds), the bubble fraction the schedule implies,
and the largest rank's parameter bytes. CPU/gloo figures: on 2 shared cores both ranks compete for
the same CPUs, so a pipeline's idle ranks free CPU for the busy one and the bubble costs less than
it would on separate devices; the point is the trend with microbatches and schedules.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist
from torch import nn

from _spawn import in_process_group, spawn

VOCAB, DIM, SEQ, GLOBAL_BATCH, CLASSES = 4096, 256, 32, 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, h):
        return self.out(self.norm(h).mean(1))


class Net(nn.Module):
    def __init__(self, blocks: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = Head()

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def make_ddp(blocks: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net(blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    half = GLOBAL_BATCH // dist.get_world_size()

    def step(x, y):
        r = dist.get_rank()
        loss_fn(model(x[r * half : (r + 1) * half]), y[r * half : (r + 1) * half]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model.module


def make_pp(blocks: int, schedule: str, microbatches: int):
    from torch.distributed.device_mesh import init_device_mesh

    from phalanx.strategies import pipeline as pipe

    torch.manual_seed(0)
    model = Net(blocks)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    chain = pipe.find_chain(model)
    per_rank = pipe.stages_per_rank(schedule)
    stages = pipe.split_stages(chain, mesh.size() * per_rank)
    rank = pipe.cut_model(
        model, chain, stages, pipe.stage_indices(schedule, mesh.get_local_rank(), mesh.size(), per_rank)
    )
    runner = pipe.PipelineRunner(
        rank.stages, rank.stage_indices, rank.num_stages, mesh["pp"], "cpu", schedule, microbatches, loss_fn
    )
    opt = torch.optim.AdamW(rank.model.parameters(), lr=1e-3)

    def step(x, y):
        runner.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, rank.model


def variants(pp: int) -> dict[str, tuple]:
    out: dict[str, tuple] = {"ddp (each rank: whole model, half the batch)": ("ddp",)}
    for schedule, m in (("1F1B", 2), ("1F1B", 4), ("1F1B", 8), ("GPipe", 4), ("Interleaved1F1B", 4)):
        out[f"pp{pp} {schedule}, {m} microbatches"] = ("pp", schedule, m)
    return out


def run(build, blocks: int, data, steps: int, warmup: int = 2) -> tuple[float, int]:
    step, model = make_ddp(blocks) if build[0] == "ddp" else make_pp(blocks, *build[1:])
    for i in range(warmup):
        step(*data[i % len(data)])
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    dist.barrier()
    rate = steps / (time.perf_counter() - start)
    held = torch.tensor([sum(p.numel() * p.element_size() for p in model.parameters())])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return rate, int(held.item())


def worker(rounds: int, steps: int, blocks: int) -> None:
    from phalanx.strategies import pipeline as pipe

    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g),
        )
        for _ in range(4)
    ]
    pp = dist.get_world_size()
    table = variants(pp)
    rates: dict[str, list[float]] = {n: [] for n in table}
    held: dict[str, int] = {}
    for r in range(rounds):
        for name in list(table) if r % 2 == 0 else list(reversed(table)):
            rate, held[name] = run(table[name], blocks, data, steps)
            rates[name].append(rate)
    if dist.get_rank() == 0:
        base_name = next(iter(table))
        base = sorted(rates[base_name])[rounds // 2]
        print(
            f"{pp} ranks (gloo, CPU, 1 thread each), {blocks} blocks of {DIM}, embedding {VOCAB}x{DIM}, global batch "
            f"{GLOBAL_BATCH}x{SEQ}; {rounds} alternating rounds of {steps} steps, median"
        )
        print(f"  {'variant':48s} {'steps/s':>8s} {'vs ddp':>7s} {'bubble':>7s} {'params/rank':>12s}")
        for name, spec in table.items():
            med = sorted(rates[name])[rounds // 2]
            bubble = (
                pipe.bubble_fraction(spec[1], pp, spec[2], pipe.stages_per_rank(spec[1])) if spec[0] == "pp" else None
            )
            print(
                f"  {name:48s} {med:8.2f} {med / base:7.3f} {'' if bubble is None else f'{bubble:.2f}':>7s} "
                f"{held[name] / 2**20:8.1f} MiB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    spawn(in_process_group, 2, worker, args.rounds, args.steps, args.blocks)


if __name__ == "__main__":
    main()
