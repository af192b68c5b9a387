"""`phalanx plan`'s step-time model against this machine: predicted and measured step time side by side.

    python bench/step_time.py [--rounds 3] [--steps 4] [--model small-vocab-encoder mlp]

Each round, this machine's device profile is measured in the job's own process group
(plan/calibrate.py, as `phalanx plan --measure-profile` does: an fp32 matmul on each of 2 ranks, a
2-rank gloo all-reduce), then bench/strategies.py's workloads (AdamW, 16 rows of 32 tokens per
data-parallel rank) run under phalanx ddp, zero3, tp 2 and pp 2 (1F1B, 4 microbatches) on 2 CPU
ranks, alternating rounds, the median step kept; beside each, the step time plan/step_time.py
predicts for the same layout, shape and that round's profile, and their ratio round by round. The
transformer encoder (4 nn.TransformerEncoderLayer) runs all but tp, which fails on it (tensor
parallel's DTensor reaches the CPU attention's backward, which has no sharding rule); the
residual-MLP model runs all four, counted as a transformer of its 4 blocks (model/flops.py's
attention term, 12·L·d·T, adds 3 % it does not run). A shared machine's load moves both sides:
read the ratio, and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import strategies  # noqa: E402 - bench/strategies.py: the workload, its variants, run_variant
import torch.distributed as dist  # noqa: E402

from _spawn import in_process_group, spawn  # noqa: E402

NOT_ON = {"small-vocab-encoder": ("phalanx tp",), "encoder": ("phalanx tp",), "mlp": ()}
LAYOUTS = {  # bench/strategies.py's variant -> (the plan's arguments, pipeline microbatches)
    "phalanx ddp": (dict(preset="ddp", dp_replicate=2), None),
    "phalanx zero3": (dict(preset="zero3", dp_shard=2, sharding=3), None),
    "phalanx tp (all ranks, same global batch)": (dict(preset="ddp", tp=2), None),
    "phalanx pp 1F1B, 2 x pp microbatches (all ranks)": (dict(preset="ddp", pp=2), 4),
}


def predicted(name: str, profile) -> float:  # noqa: ANN001
    """The model's step time for variant `name` on 2 ranks of this machine's `profile`."""
    from phalanx.model import flops
    from phalanx.plan import step_time
    from phalanx.strategies.plan.parallel_plan import ParallelPlan, Sharding

    fields, microbatches = LAYOUTS[name]
    plan = ParallelPlan(**{**fields, "sharding": Sharding(fields.get("sharding", 0))})
    model = strategies.make_model()
    replica = round(1 / plan.flops_share)  # a replica's tp x pp ranks read its batch together
    outside = sum(p.numel() for p in model.parameters()) - model.embed.weight.numel()
    shape = step_time.Shape(
        params=sum(p.numel() for p in model.parameters()),
        flops=flops.transformer_shape(model)
        or flops.TransformerShape(outside, outside, strategies.BLOCKS, strategies.DIM),
        kv_width=strategies.DIM,
        vocab=model.vocab,
        seq_len=strategies.SEQ,
        tokens=strategies.BATCH * replica * strategies.SEQ,
        dtype_bytes=4,
    )
    return step_time.estimate(plan, shape, profile, step_time.Pipeline("1F1B", microbatches)).step


def worker(rounds: int, steps: int, seconds: float) -> None:
    """Each round: this machine's profile measured in the job's own group (plan/calibrate.py), then every
    layout; the ratio is taken round by round, so a change of load between rounds moves both sides."""
    from phalanx.plan import calibrate

    names = [n for n in LAYOUTS if not n.startswith(NOT_ON[strategies.MODEL])]
    data = {n: strategies.batches(8, strategies.REPLICA_OF.get(n, lambda: 1)()) for n in names}
    measured: dict[str, list[float]] = {n: [] for n in names}
    guessed: dict[str, list[float]] = {n: [] for n in names}
    profiles = []
    for r in range(rounds):
        profiles.append(calibrate.profile(calibrate.figures_in_group(seconds)))
        for name in names if r % 2 == 0 else list(reversed(names)):
            measured[name].append(1 / strategies.run_variant(strategies.VARIANTS[name], data[name], steps)[0])
            guessed[name].append(predicted(name, profiles[-1]))
    if dist.get_rank() == 0:
        print(f"2 CPU ranks, {strategies.MODEL} model, {rounds} alternating rounds of {steps} steps, median")
        for p in profiles:
            print(
                f"  round's profile: {p.peak_flops / 1e9:.1f} GFLOP/s per rank x {p.matmul_efficiency:.2f} in a "
                f"transformer block, all-reduce "
                f"{p.intra_bandwidth / 1e6:.0f} MB/s + {p.intra_latency * 1e6:.0f} us a call, memory "
                f"{p.memory_bandwidth / 1e9:.1f} GB/s"
            )
        print(f"  {'layout':50s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s} {'per round':>12s}")
        for name in names:
            ratios = sorted(g / m for g, m in zip(guessed[name], measured[name]))
            guess, real = sorted(guessed[name])[rounds // 2], sorted(measured[name])[rounds // 2]
            print(
                f"  {name:50s} {guess * 1e3:8.0f}ms {real * 1e3:8.0f}ms {ratios[rounds // 2]:6.2f} "
                f"{ratios[0]:5.2f}-{ratios[-1]:.2f}"
            )
        print(f"  load average after: {os.getloadavg()}")


def _run(rounds: int, steps: int, seconds: float) -> None:
    in_process_group(worker, rounds, steps, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--calibrate-seconds", type=float, default=3.0, help="the profile's measurement, each round")
    parser.add_argument("--model", nargs="+", default=["small-vocab-encoder", "mlp"], choices=sorted(NOT_ON))
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    for model in args.model:
        os.environ["BENCH_MODEL"] = model  # read by each spawned rank when it imports strategies.py
        strategies.MODEL = model
        spawn(_run, 2, args.rounds, args.steps, args.calibrate_seconds)


if __name__ == "__main__":
    main()
