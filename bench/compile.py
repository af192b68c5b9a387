"""compile=True vs eager: steps/s of phalanx with each sharding unit compiled, side by side.

    python bench/compile.py [--world-size 2] [--rounds 3] [--steps 10] [--strategies ddp zero3]

The workload of bench/strategies.py (embedding + residual MLP blocks + head, AdamW), one process
group, alternating rounds; compilation happens in the warm-up steps and is not timed (inductor's
cache makes later rounds' compilations quick). Prints median steps/s and compiled / eager.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist

from _spawn import in_process_group, spawn
from strategies import BATCH, SEQ, batches, make_model, run_variant


def build(strategy: str, compiled: bool) -> Callable:
    def make():
        from phalanx import Phalanx

        px = Phalanx(strategy=strategy, compile=compiled)
        model = make_model()
        model, opt = px.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, opt, px.backward

    return make


def worker(rounds: int, steps: int, strategies: list[str]) -> None:
    names = {f"{s} {'compiled' if c else 'eager'}": build(s, c) for s in strategies for c in (False, True)}
    data = batches(8)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in list(names) if r % 2 == 0 else list(reversed(names)):
            rates[name].append(run_variant(names[name], data, steps, warmup=3)[0])
    if dist.get_rank() == 0:
        med = {n: sorted(v)[rounds // 2] for n, v in rates.items()}
        print(
            f"{dist.get_world_size()} ranks (gloo, CPU), batch {BATCH}x{SEQ} per rank; "
            f"{rounds} alternating rounds of {steps} steps, median steps/s"
        )
        for s in strategies:
            eager, compiled = med[f"{s} eager"], med[f"{s} compiled"]
            print(f"  {s:6s} eager {eager:7.2f}  compiled {compiled:7.2f}  compiled/eager {compiled / eager:5.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--strategies", nargs="*", default=["ddp", "zero3"])
    args = parser.parse_args()
    spawn(in_process_group, args.world_size, worker, args.rounds, args.steps, args.strategies)


if __name__ == "__main__":
    main()
