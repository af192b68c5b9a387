"""What watching a job costs: steps/s with the step anatomy, straggler attribution and a dashboard
with a browser polling it, on and off, in alternating rounds on one process group.

    python bench/observe.py [--world-size 2] [--rounds 6] [--steps 300]   (BENCH_HIDDEN=512)

Variants (the same prepared model, optimizer and loader; the watchdog thread runs in all of them):
- off:         no anatomy (the step tracker's hook unset), no exchange;
- anatomy:     phase times on every rank, nothing published;
- attribution: plus the exchange on the watchdog's heartbeat (every rank publishes its summary,
               rank 0 judges stragglers and rewrites RUN_DIR/observe/status.json once a second);
- dashboard:   plus `phalanx run --dashboard`'s server in a process of its own (as the launcher runs
               it) with a client fetching /api/page every second, as an open browser tab does.
Prints rank 0's median steps/s per variant and each ratio to off, then the costs measured directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from _spawn import spawn
from _workload import BATCH, HIDDEN, dataset, endless, make_model, run_round

SAMPLES = 8192
SERVE = """
import sys, threading, time, urllib.request
from phalanx.observe.dashboard import Dashboard
board = Dashboard(sys.argv[1], "127.0.0.1:0").start()
print(board.url, flush=True)
def browse():
    while True:
        urllib.request.urlopen(board.url + "api/page").read()
        time.sleep(1.0)
threading.Thread(target=browse, daemon=True).start()
sys.stdin.read()  # until the bench closes our stdin
"""


def bench(rounds: int, steps: int, run_dir: str) -> None:
    from phalanx import Phalanx

    px = Phalanx(run_dir=run_dir, log_sinks=["jsonl"])
    tracker, exchange, watchdog = px._step_progress, px._observe, px.watchdog
    anatomy = tracker.anatomy
    model = px.prepare_model(make_model())
    opt = px.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    loop = (
        endless(px.prepare_data_loader(DataLoader(dataset(SAMPLES), batch_size=BATCH, shuffle=True))),
        model,
        opt,
        px.backward,
    )

    def configure(name: str) -> subprocess.Popen | None:
        tracker.anatomy = None if name == "off" else anatomy
        if exchange.tick in watchdog._listeners:
            watchdog._listeners.remove(exchange.tick)
        if name in ("attribution", "dashboard"):
            watchdog.add_listener(exchange.tick)
        if name == "dashboard" and px.is_main_process:
            server = subprocess.Popen(
                [sys.executable, "-c", SERVE, run_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            server.stdout.readline()  # serving: the round starts now
            return server
        return None

    results: dict[str, list[float]] = {"off": [], "anatomy": [], "attribution": [], "dashboard": []}
    run_round(steps // 4, *loop)  # warm-up
    order = list(results)
    for index in range(rounds):
        for name in order[index % 4 :] + order[: index % 4]:  # rotate: no variant always runs first
            server = configure(name)
            results[name].append(run_round(steps, *loop))
            if server is not None:
                server.stdin.close()
                server.wait(timeout=30)
    # Directly, free of the machine's noise: the anatomy's work per step (~7 phase changes), and one
    # heartbeat's exchange (rank 0: publish, read every rank, judge, write the status).
    start = time.perf_counter()
    for _ in range(20000):
        tracker.before_batch()
        tracker.next_step()
        tracker.enter("forward")
        tracker.enter("step")
        with tracker.during("backward"):
            pass
        tracker.enter("optimizer")
        tracker.enter("step")
    anatomy_us = (time.perf_counter() - start) / 20000 * 1e6
    store = watchdog.store.underlying_store
    start = time.perf_counter()
    for _ in range(20):
        exchange.tick(store)
    tick_ms = (time.perf_counter() - start) / 20 * 1e3
    dist.barrier()
    if px.is_main_process:
        base = statistics.median(results["off"])
        step_us = 1e6 / base
        print(
            f"hidden={HIDDEN} world={px.world_size} rounds={rounds} steps/round={steps} step={step_us / 1e3:.2f} ms (off)"
        )
        for name, values in results.items():
            med = statistics.median(values)
            print(
                f"  {name:12s} {med:8.1f} steps/s  ratio to off {med / base:.4f}   "
                f"rounds: {' '.join(f'{v:.0f}' for v in values)}"
            )
        print(
            f"  direct: anatomy {anatomy_us:.2f} us per step = {100 * anatomy_us / step_us:.3f}% of a "
            f"{step_us / 1e3:.2f} ms step; exchange {tick_ms:.2f} ms per heartbeat (1/s, watchdog thread) "
            f"on rank 0 = {tick_ms / 10:.3f}% of wall time"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        spawn(bench, args.world_size, args.rounds, args.steps, run_dir)


if __name__ == "__main__":
    main()
