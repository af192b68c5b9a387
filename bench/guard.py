"""The speed guard: phalanx ddp, zero1 and zero3 against hand-written DDP, each ratio beside its floor.

    python bench/guard.py [--budget 60] [--rounds 400] [--warmup 3]

One process group of 2 CPU ranks, on bench/strategies.py's small-vocab transformer encoder classifier
(4 nn.TransformerEncoderLayers, 4096x256 embedding, batch 16x32 tokens per process, AdamW), the
variants built by bench/strategies.py. All four variants are built once and kept side by side; a
round is one training step of each, the order reversed every other round, so a change in the
machine's speed (a VM's CPU time per step here moves by 30% and more within a minute) reaches every
variant alike. Each ratio is the median over rounds of the ratio within a round, of rank 0's CPU
time per step (what the floors are read against: on a shared machine other processes steal
wall-clock time, not CPU time), with the same ratio of wall time per step beside it. The floors are
the ones docs/strategies.md promises; the hand-written loop is `DDP(model)` as torch's tutorial
writes it. A report, not a test: it exits 0 whatever it measures (`.ci/run` prints it before the
tests); a change that moves a ratio by more than 5% says why in its commit. Rounds run while they
fit in `--budget` seconds (at least 5, at most `--rounds`), so the whole command ends within about
90 s on a loaded 2-core machine.

zero3 runs with `host_mmap_threshold: 0`: its default (`auto`) fixes glibc's mmap threshold at
1 MiB, and mallopt's threshold, once fixed, holds for the whole process, so every variant would
run under it. With 0 every variant runs at glibc's default, as ddp's and zero1's `auto` does.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the command's own start: what the 90 s promise counts

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

os.environ.setdefault("BENCH_MODEL", "small-vocab-encoder")  # read by strategies.py at import, in every rank
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import strategies  # noqa: E402
from _spawn import in_process_group, spawn  # noqa: E402

HAND = "hand-written DDP"
MIN_ROUNDS = 5  # the fewest rounds a median is read from, whatever the time budget
VARIANTS = {
    HAND: lambda: strategies.raw_ddp(gradient_as_bucket_view=False),  # DDP(model), torch's tutorial
    "phalanx ddp": strategies.with_phalanx("ddp"),
    "phalanx zero1": strategies.with_phalanx("zero1"),
    "phalanx zero3": strategies.with_phalanx("zero3", settings={"host_mmap_threshold": 0}),
}
# (variant, the variant it is compared with, the floor the docs promise)
FLOORS = (("phalanx ddp", HAND, 1.10), ("phalanx zero1", "phalanx ddp", 0.95), ("phalanx zero3", "phalanx ddp", 0.80))
ONE = "one process"
"""The same step in one process, no DDP (the model, batch 16x32 and fused AdamW phalanx ddp steps):
rank 0 runs it while rank 1 waits, so twice its samples/s is what 2 processes could reach at best."""
SCALING_FLOOR = 0.80  # phalanx ddp's samples/s over twice one process's


def one_process() -> tuple:
    model = strategies.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return model, optimizer, strategies.plain_step(model)


def _median_ratio(per_round: dict[str, list[float]], name: str, base: str, inverse: bool = False) -> float:
    ratios = [(b / x) if inverse else (x / b) for x, b in zip(per_round[name], per_round[base])]
    return statistics.median(ratios)


def _in_budget(started: float, done: int, budget: float) -> bool:
    """Whether one more round, as long as the rounds so far took on average, ends within `budget`
    seconds of `started`: rank 0's clock decides for every rank, so they stop together."""
    elapsed = time.perf_counter() - started
    fits = torch.tensor([int(elapsed + elapsed / done <= budget)])
    dist.broadcast(fits, src=0)
    return bool(fits.item())


def _step(variant: tuple, batch: tuple) -> None:
    """One training step as the guard times it: zero_grad, forward and backward, the optimizer's step."""
    _, optimizer, forward_backward = variant
    optimizer.zero_grad(set_to_none=True)
    forward_backward(*batch)
    optimizer.step()


def worker(rounds: int, warmup: int, budget: float) -> None:
    started = time.perf_counter()
    names = list(VARIANTS)
    data = strategies.batches(8)
    built = {name: VARIANTS[name]() for name in names}  # side by side for the whole run
    built[ONE] = one_process()
    timed = [*names, ONE]
    alone = dist.get_rank() == 0  # the one-process step runs on rank 0 only
    for name in timed:
        for i in range(warmup):
            if name != ONE or alone:
                _step(built[name], data[i % len(data)])
    cpu: dict[str, list[float]] = {n: [] for n in timed}
    wall: dict[str, list[float]] = {n: [] for n in timed}
    done = 0
    while done < rounds and (done < MIN_ROUNDS or _in_budget(started, done, budget)):
        batch = data[done % len(data)]
        for name in timed if done % 2 == 0 else timed[::-1]:
            dist.barrier()  # both ranks start the step together: its wall time is the step's
            if name == ONE and not alone:
                continue  # rank 1 waits in the next barrier while rank 0 steps alone
            wall_start, cpu_start = time.perf_counter(), time.process_time()  # this process, all its threads
            _step(built[name], batch)
            cpu[name].append((time.process_time() - cpu_start) * 1000)
            wall[name].append((time.perf_counter() - wall_start) * 1000)
        done += 1
    dist.barrier()
    if dist.get_rank() != 0:
        return
    params = sum(p.numel() for p in strategies.make_model().parameters())
    world = dist.get_world_size()
    print(
        f"speed guard (a report, not a test): {strategies.MODEL} {params / 1e6:.1f}M parameters, batch "
        f"{strategies.BATCH}x{strategies.SEQ} per process, AdamW, {world} CPU ranks (1 thread each), "
        f"{done} rounds of one step of each variant, alternating ({time.perf_counter() - started:.0f} s); each "
        f"ratio: the median over rounds of the ratio within a round"
    )
    for name in names:
        per_step = statistics.median(wall[name])
        samples = strategies.BATCH * world * 1000 / per_step
        print(f"  {name:18s} {samples:7.1f} samples/s  {statistics.median(cpu[name]):6.1f} CPU ms/step (rank 0)")
    for name, base, floor in FLOORS:
        cpu_speed = _median_ratio(cpu, name, base, inverse=True)
        speed = _median_ratio(wall, name, base, inverse=True)
        verdict = "ok" if cpu_speed >= floor else "BELOW"
        print(
            f"  {name:14s} vs {base:16s} {cpu_speed:5.2f}x (CPU time per step; wall time {speed:4.2f}x)   "
            f"floor {floor:.2f}x  {verdict}"
        )
    scaling = _median_ratio(wall, "phalanx ddp", ONE, inverse=True)  # 2 x 16 samples in its time, 16 in one's
    one = strategies.BATCH * 1000 / statistics.median(wall[ONE])
    print(
        f"  phalanx ddp    vs 2 x one process   {scaling:5.2f}  (samples/s over twice one process's, "
        f"{one:.1f} samples/s)   floor {SCALING_FLOOR:.2f}   {'ok' if scaling >= SCALING_FLOOR else 'BELOW'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400, help="the most rounds (at least 5 run)")
    parser.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds the rounds may take: no round starts that would end later (the ranks' start adds ~10-20 s)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="steps of each variant before the timing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-guard-") as run_dir:
        # the ranks inherit these: each variant's run files in a directory removed after, warnings only
        os.environ.update(PHALANX_RUN_DIR=run_dir, PHALANX_LOG_LEVEL="WARNING")
        spawn(in_process_group, 2, worker, args.rounds, args.warmup, args.budget)
    print(
        f"  ({time.perf_counter() - STARTED:.0f} s in all; on a shared machine ratios move by several %: rerun before "
        f"reading one below its floor as a regression)"
    )


if __name__ == "__main__":
    main()
