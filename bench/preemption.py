"""What the preemption path costs while no signal has come: steps/s with it on and off, side by side.

    python bench/preemption.py [--world-size 2] [--rounds 6] [--steps 400]   (BENCH_HIDDEN=512; 32 for a tiny model)

One process group, one model, one prepared loader; round after round (alternating) the same loop
runs with preemption's hooks in place (the default when checkpoint_dir is set: a test of one
attribute before each batch and after each optimizer step, plus one store `check` per second on
the watchdog's thread) and with them taken out. Also measured directly, free of the machine's
noise: the hook's cost per batch, the store check's cost per second, and, for comparison, what an
all-reduce of a stop flag at every step (the design not taken) would cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from _spawn import spawn
from _workload import BATCH, HIDDEN, dataset, make_model

SAMPLES = 8192


def endless(loader):
    while True:
        yield from loader


def run_round(steps: int, batches, model, opt, px, flag_all_reduce: bool = False) -> float:
    flag = torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        px.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        if flag_all_reduce:
            dist.all_reduce(flag)
    dist.barrier()
    return steps / (time.perf_counter() - start)


def bench(rounds: int, steps: int, checkpoint_dir: str) -> None:
    from phalanx import Phalanx

    px = Phalanx(checkpoint_dir=checkpoint_dir)  # preemption on (default signals), watchdog on (default)
    preemption = px._preemption
    assert preemption is not None
    model = px.prepare_model(make_model())
    opt = px.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    batches = endless(px.prepare_data_loader(DataLoader(dataset(SAMPLES), batch_size=BATCH, shuffle=True)))
    progress, checkpointer, watchdog = px._step_progress, px._checkpointer, px.watchdog

    def hooks(on: bool) -> None:
        progress.on_batch_request = preemption.before_batch if on else None
        checkpointer.step_listeners[:] = [preemption.after_step] if on else []
        if watchdog is not None:
            watchdog._listeners[:] = [preemption.poll] if on else []

    results: dict[str, list[float]] = {"off": [], "on": [], "on + all-reduce per step": []}
    run_round(steps // 4, batches, model, opt, px)  # warm-up
    names = list(results)
    for index in range(rounds):
        for name in names[index % 3 :] + names[: index % 3]:  # rotate: no variant always runs first
            hooks(name != "off")
            results[name].append(run_round(steps, batches, model, opt, px, flag_all_reduce="all-reduce" in name))
    hooks(True)
    with px.busy("bench: direct timings"):  # ranks finish these at different times: not a stall
        direct(px, progress, preemption)
    report(px, results, rounds, steps)


def direct(px, progress, preemption) -> None:
    """The hook per batch, the store check per second, a flag all-reduce per step."""
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        progress.before_batch()
    hook_ns = (time.perf_counter() - start) / n * 1e9
    progress.on_batch_request = None
    start = time.perf_counter()
    for _ in range(n):
        progress.before_batch()
    bare_ns = (time.perf_counter() - start) / n * 1e9
    store = preemption._own_store()
    start = time.perf_counter()
    for _ in range(500):
        preemption.poll(store)
    poll_us = (time.perf_counter() - start) / 500 * 1e6
    flag = torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(500):
        dist.all_reduce(flag)
    all_reduce_us = (time.perf_counter() - start) / 500 * 1e6
    dist.barrier()
    px._bench_direct = (hook_ns - bare_ns, poll_us, all_reduce_us)


def report(px, results, rounds: int, steps: int) -> None:
    hook_ns, poll_us, all_reduce_us = px._bench_direct
    if px.is_main_process:
        base = statistics.median(results["off"])
        step_us = 1e6 / base
        print(
            f"hidden={HIDDEN} world={px.world_size} rounds={rounds} steps/round={steps} step={step_us / 1e3:.2f} ms "
            f"(preemption off), load {os.getloadavg()[0]:.1f}"
        )
        for name, values in results.items():
            med = statistics.median(values)
            print(
                f"  {name:26s} {med:8.1f} steps/s  ratio to off {med / base:.4f}   "
                f"rounds: {' '.join(f'{v:.0f}' for v in values)}"
            )
        print(
            f"  direct: hook {hook_ns:.0f} ns per batch (+ the same after each step) = "
            f"{100 * 2 * hook_ns / 1e3 / step_us:.4f}% of a step; store check {poll_us:.0f} us once a "
            f"second = {poll_us / 1e4:.4f}% of wall time; a flag all-reduce per step would be {all_reduce_us:.0f} us "
            f"= {100 * all_reduce_us / step_us:.2f}% of a step"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-preempt-") as checkpoint_dir:
        spawn(bench, args.world_size, args.rounds, args.steps, checkpoint_dir)


if __name__ == "__main__":
    main()
