"""phalanx's loop vs a hand-written DDP loop on the same workload, alternating rounds.

    python bench/overhead.py [--world-size 2] [--rounds 6] [--steps 60]

Prints steps/s of: hand-written default DDP, hand-written DDP with tuned settings, and phalanx;
each ratio to default DDP. One process group serves all variants, so they share its costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from _spawn import spawn
from _workload import BATCH, dataset, make_model

SAMPLES = 4096


def hand_written(steps: int, **ddp_kwargs) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model(), **ddp_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(dataset(SAMPLES), num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    return _time_loop(steps, lambda epoch: (sampler.set_epoch(epoch), loader)[1], model, opt, lambda l: l.backward())


def with_phalanx(steps: int, **strategy_options) -> float:
    from phalanx import Phalanx

    px = Phalanx(strategy_options=strategy_options or None)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(SAMPLES), batch_size=BATCH, shuffle=True)
    model, opt, loader = px.prepare(model, opt, loader)
    return _time_loop(steps, lambda epoch: loader, model, opt, px.backward)


def _time_loop(steps, loader_for_epoch, model, opt, backward) -> float:
    done, epoch, start = 0, 0, None
    warmup = 5
    while done < steps + warmup:
        for x, y in loader_for_epoch(epoch):
            if done == warmup:
                dist.barrier()
                start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            done += 1
            if done == steps + warmup:
                break
        epoch += 1
    dist.barrier()
    return steps / (time.perf_counter() - start)


VARIANTS = {
    "ddp (default)": lambda steps: hand_written(steps),
    "ddp (bucket view)": lambda steps: hand_written(steps, gradient_as_bucket_view=True),
    "ddp (bucket view, 100MB buckets)": lambda steps: hand_written(
        steps, gradient_as_bucket_view=True, bucket_cap_mb=100
    ),
    "phalanx": with_phalanx,
    "phalanx (100MB buckets)": lambda steps: with_phalanx(steps, extra={"ddp_kwargs": {"bucket_cap_mb": 100}}),
}


def worker(rounds: int, steps: int) -> None:
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            rates[name].append(VARIANTS[name](steps))
    if dist.get_rank() == 0:
        base = sorted(rates["ddp (default)"])[rounds // 2]
        print(f"{dist.get_world_size()} ranks, {rounds} alternating rounds of {steps} steps; median steps/s")
        for name, values in rates.items():
            med = sorted(values)[rounds // 2]
            print(f"  {name:34s} {med:8.1f} steps/s   ratio to default DDP {med / base:5.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    spawn(_run, args.world_size, args.rounds, args.steps)


def _run(rounds: int, steps: int) -> None:
    dist.init_process_group("gloo")
    try:
        worker(rounds, steps)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
