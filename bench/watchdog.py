"""What the watchdog costs in steady state: steps/s with and without it, alternating rounds.

    python bench/watchdog.py [--world-size 2] [--rounds 5] [--steps 400]   (BENCH_HIDDEN=512)

Three variants share one process group and one model size, round after round:
- bare:     the strategy's model and the prepared loader with no progress bookkeeping at all;
- progress: the phalanx loop as users run it (phase hooks on model/optimizer, px.backward, loader
            steps), watchdog thread off;
- watchdog: the same plus the watchdog thread (default 60 s timeout: one store `set` per second).
Prints rank 0's median steps/s per variant and each ratio to bare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from _spawn import spawn
from _workload import BATCH, HIDDEN, dataset, endless, make_model, run_round

SAMPLES = 8192


def bench(rounds: int, steps: int) -> None:
    from phalanx import Phalanx
    from phalanx.data.loader import PreparedLoader
    from phalanx.runtime.watchdog import _PREFIX, Watchdog

    px = Phalanx(watchdog_timeout=0)  # threads started by hand below, round by round
    loader = DataLoader(dataset(SAMPLES), batch_size=BATCH, shuffle=True)

    bare_model = px.strategy.setup_model(make_model())  # no phase hooks
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
    bare = (endless(PreparedLoader(loader, px.ctx, progress=None)), bare_model, bare_opt, px.strategy.backward)

    model = px.prepare_model(make_model())
    opt = px.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    full = (endless(px.prepare_data_loader(loader)), model, opt, px.backward)

    store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store().clone())
    results: dict[str, list[float]] = {"bare": [], "progress": [], "watchdog": []}
    run_round(steps // 4, *bare)  # warm-up
    run_round(steps // 4, *full)
    order = list(results)
    for index in range(rounds):
        for name in order[index % 3 :] + order[: index % 3]:  # rotate: no variant always runs first
            if name == "watchdog":
                watchdog = Watchdog(store, px.rank, px.world_size, px._step_progress, 60.0).start()
            results[name].append(run_round(steps, *(bare if name == "bare" else full)))
            if name == "watchdog":
                watchdog.stop()
    # The same costs measured directly, free of the machine's noise: the thread's work per wake-up
    # (one store set), and the main thread's bookkeeping per step (~6 phase changes).
    publish = Watchdog(store, px.rank, px.world_size, px._step_progress, 60.0)
    start = time.perf_counter()
    for _ in range(200):
        publish._publish()
    publish_us = (time.perf_counter() - start) / 200 * 1e6
    start = time.perf_counter()
    for _ in range(20000):
        px._step_progress.next_step()
        px._step_progress.enter("forward")
        px._step_progress.enter("step")
        with px._step_progress.during("backward"):
            pass
        px._step_progress.enter("optimizer")
        px._step_progress.enter("step")
    bookkeeping_us = (time.perf_counter() - start) / 20000 * 1e6
    dist.barrier()
    if px.is_main_process:
        base = statistics.median(results["bare"])
        print(
            f"hidden={HIDDEN} world={px.world_size} rounds={rounds} steps/round={steps} step={1e3 / base:.2f} ms (bare)"
        )
        for name, values in results.items():
            med = statistics.median(values)
            print(
                f"  {name:9s} {med:8.1f} steps/s  ratio to bare {med / base:.4f}   "
                f"rounds: {' '.join(f'{v:.0f}' for v in values)}"
            )
        ratio = statistics.median(results["watchdog"]) / statistics.median(results["progress"])
        print(f"  watchdog thread on/off ratio: {ratio:.4f} (cost {100 * (1 - ratio):+.2f}% of step time)")
        step_us = 1e6 / base
        print(
            f"  direct: thread publish {publish_us:.0f} us per wake-up (1/s) = {publish_us / 1e4:.4f}% of wall time; "
            f"bookkeeping {bookkeeping_us:.2f} us per step = {100 * bookkeeping_us / step_us:.4f}% of a "
            f"{step_us / 1e3:.2f} ms step"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    spawn(bench, args.world_size, args.rounds, args.steps)


if __name__ == "__main__":
    main()
