"""Where a training step's time goes, per strategy: torch.profiler on rank 0, ops grouped by kind.

    python bench/profile_step.py [--model encoder] [--strategies "raw ddp" "phalanx zero3"] [--steps 8]

Uses bench/strategies.py's workloads and variants. For each variant, rank 0 profiles `--steps`
steps after warm-up and prints its CPU time per step split into compute (forward/backward kernels),
communication (gloo collectives: the calls and the time waiting for peers), DTensor and FSDP2
bookkeeping (dispatch, copies into and out of the communication buffers), the optimizer step, and
the rest. CPU time, not wall time: on a shared machine the split stays meaningful while wall-clock
rates swing with the other processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch
import torch.distributed as dist

from _spawn import spawn

# Self-CPU time of each profiler event goes to the first group whose words appear in its name.
GROUPS = (
    (
        "communication",
        (
            "all_reduce",
            "allreduce",
            "all_gather",
            "allgather",
            "reduce_scatter",
            "gloo",
            "c10d",
            "broadcast",
            "wait",
            "barrier",
        ),
    ),
    (
        "FSDP2 / DTensor bookkeeping",
        (
            "fsdp",
            "FSDP",
            "DTensor",
            "dtensor",
            "redistribute",
            "foreach_copy",
            "split_with_sizes_copy",
            "chunk_cat",
            "_to_copy",
            "copy_",
            "cat",
            "as_strided",
            "view",
            "empty",
            "resize",
            "narrow",
            "slice",
            "detach",
        ),
    ),
    ("optimizer", ("Optimizer", "adam", "_foreach", "addcdiv", "lerp", "sqrt")),
    (
        "compute",
        (
            "mm",
            "addmm",
            "bmm",
            "linear",
            "matmul",
            "gelu",
            "layer_norm",
            "softmax",
            "embedding",
            "attention",
            "dropout",
            "relu",
            "cross_entropy",
            "nll",
            "sum",
            "mean",
            "mul",
            "add",
            "div",
            "threshold",
            "native_",
        ),
    ),
)


def group_of(name: str) -> str:
    for group, words in GROUPS:
        if any(word in name for word in words):
            return group
    return "other"


def profile_variant(name: str, steps: int) -> dict[str, float]:
    import strategies as workloads  # bench/strategies.py: models, batches, variants

    model, opt, train_step = workloads.VARIANTS[name]()  # train_step(x, y): forward, loss, backward
    replica = workloads.REPLICA_OF[name]() if name in workloads.REPLICA_OF else 1
    data = workloads.batches(steps, replica)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        train_step(x, y)
        opt.step()

    for i in range(3):
        step(i)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i)
    dist.barrier()
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        totals[group_of(event.key)] += event.self_cpu_time_total / 1000 / steps
        top[event.key] += event.self_cpu_time_total / 1000 / steps
    totals["top ops"] = 0.0
    return {**totals, **{f"  {k}": v for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]}}


def worker(names: list[str], steps: int) -> None:
    dist.init_process_group("gloo")
    try:
        results = {name: profile_variant(name, steps) for name in names}
        if dist.get_rank() == 0:
            print(f"rank 0's self CPU ms per step, {steps} profiled steps, model {os.environ['BENCH_MODEL']}")
            for name, groups in results.items():
                total = sum(v for k, v in groups.items() if not k.startswith("  "))
                print(f"\n{name}: {total:.1f} ms")
                for key, value in groups.items():
                    if key == "top ops":
                        print("  top ops:")
                    elif value:
                        print(f"  {key:60s} {value:8.2f}")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="encoder")
    parser.add_argument("--strategies", nargs="+", default=["raw ddp", "phalanx zero3"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    os.environ["BENCH_MODEL"] = args.model
    spawn(worker, args.world_size, args.strategies, args.steps)


if __name__ == "__main__":
    main()
