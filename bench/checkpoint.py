"""Checkpoint throughput and training stall, side by side in one run (alternating rounds).

1. Save/load MB/s of `px.save_state`/`px.load_state` (DCP shards, fsync, sha256 manifest, verify
   on load, atomic publish) vs plain `torch.save`/`torch.load` of the same model+optimizer state
   (also with an fsync, the durable equivalent).
2. The training-loop stall of an async save vs a blocking one: how long `save_state()` keeps the
   loop from its next step, and the loop's total time with a save every few steps.
3. The step time while an async save is in flight / the step time without one, to a local disk and
   to S3 (moto's S3 server on loopback, when `moto[server]` and `s3fs` are installed), side by side.

Usage: python bench/checkpoint.py [--world-size 1] [--hidden 2048] [--layers 8] [--rounds 3] [--no-s3]
(world size 1 runs in this process; more ranks are spawned on CPU/gloo, each writing its shard).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(hidden: int, layers: int):
    from phalanx import Phalanx

    px = Phalanx()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = px.prepare(model, optimizer)
    return px, model, optimizer


def train_step(model, optimizer, px, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    px.backward(model(batch).square().mean())
    optimizer.step()


def state_mb(model, optimizer) -> float:
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def throughput(px, model, optimizer, work: Path, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {
        k: [] for k in ("torch.save", "torch.save+fsync", "phalanx save", "torch.load", "phalanx load")
    }
    for r in range(rounds):
        # alternate which goes first, so caches and background writeback favour neither
        order = ["torch", "phalanx"] if r % 2 == 0 else ["phalanx", "torch"]
        for who in order:
            if who == "torch":
                if px.is_main_process:  # plain torch.save holds the whole state in one process
                    path = work / f"plain-{r}.pt"
                    t = time.perf_counter()
                    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)
                    times["torch.save"].append(time.perf_counter() - t)
                    fsync_file(path)
                    times["torch.save+fsync"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    state = torch.load(path, weights_only=True)
                    model.load_state_dict(state["model"])
                    optimizer.load_state_dict(state["optim"])
                    times["torch.load"].append(time.perf_counter() - t)
                    path.unlink()
                px.wait_for_everyone()
            else:
                path = work / f"phalanx-{r}"
                px.wait_for_everyone()
                t = time.perf_counter()
                px.save_state(path)
                px.wait_for_everyone()
                times["phalanx save"].append(time.perf_counter() - t)
                t = time.perf_counter()
                assert px.load_state(path)
                times["phalanx load"].append(time.perf_counter() - t)
                if px.is_main_process:
                    shutil.rmtree(path)
                px.wait_for_everyone()
    return times


def stall(px, model, optimizer, work: Path, rounds: int, steps: int, every: int, hidden: int) -> dict[str, list[float]]:
    batch = torch.randn(32, hidden)
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for mode in ["blocking", "async"] if r % 2 == 0 else ["async", "blocking"]:
            stalls, root = [], work / f"loop-{mode}-{r}"
            t_loop = time.perf_counter()
            for step in range(1, steps + 1):
                train_step(model, optimizer, px, batch)
                if step % every == 0:
                    t = time.perf_counter()
                    px.save_state(root / f"step-{step:08d}", async_save=(mode == "async"))
                    stalls.append(time.perf_counter() - t)
            px.wait_for_checkpoint()
            out.setdefault(f"{mode} stall per save", []).append(statistics.mean(stalls))
            out.setdefault(f"{mode} loop total", []).append(time.perf_counter() - t_loop)
            px.wait_for_everyone()
            if px.is_main_process:
                shutil.rmtree(root)
            px.wait_for_everyone()
    t = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, px, batch)
    out["no-save loop total"] = [time.perf_counter() - t]
    return out


def in_flight(px, model, optimizer, root, rounds: int, hidden: int, writers: list[str]) -> dict[str, dict[str, float]]:
    """Per writer: median step time with no save, and during an async save (the steps between its start
    and its end). Several writers alternate round by round, so the machine's load drifts over both."""
    from phalanx.checkpoint import writer_process

    supported = writer_process.supported
    batch = torch.randn(32, hidden)

    def timed_step() -> float:
        t = time.perf_counter()
        train_step(model, optimizer, px, batch)
        return time.perf_counter() - t

    quiet = [timed_step() for _ in range(10)]
    t = time.perf_counter()
    px.save_state(root / "blocking", async_save=False)
    save_s = time.perf_counter() - t
    steps_per_save = max(3, round(save_s / statistics.median(quiet)))
    seen = {w: {"quiet": list(quiet), "during": [], "stalls": [], "waits": [], "ratios": []} for w in writers}
    for r in range(rounds):  # paired: the steps just before a save against the steps during it
        for writer in writers if r % 2 == 0 else writers[::-1]:
            writer_process.supported = supported if writer == "process" else (lambda: False)
            mine = seen[writer]
            before = [timed_step() for _ in range(steps_per_save)]
            t = time.perf_counter()
            px.save_state(root / f"async-{writer}-{r}", async_save=True)
            mine["stalls"].append(time.perf_counter() - t)
            during = [timed_step() for _ in range(steps_per_save)]  # about as long as one save takes
            t = time.perf_counter()
            px.wait_for_checkpoint()
            mine["waits"].append(time.perf_counter() - t)
            mine["quiet"] += before
            mine["during"] += during
            mine["ratios"].append(statistics.median(during) / statistics.median(before))
    writer_process.supported = supported
    return {
        w: {
            "step s": statistics.median(m["quiet"]),
            "step s, save in flight": statistics.median(m["during"]),
            "ratio (median of pairs)": statistics.median(m["ratios"]),
            "blocking save s": save_s,
            "async start s": statistics.median(m["stalls"]),
            "left to wait s": statistics.median(m["waits"]),
            "steps per save": steps_per_save,
        }
        for w, m in seen.items()
    }


def in_flight_report(px, model, optimizer, work: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from phalanx.checkpoint.object_path import location

    writers = ["process", "thread"] if args.writer == "both" else [args.writer]
    where = {"local disk": work / "inflight"}
    url = os.environ.get("BENCH_S3_URL")
    if url:
        where["S3 (moto)"] = location(url)
    results = {}
    for name, root in where.items():
        for writer, figures in in_flight(px, model, optimizer, root, args.rounds, args.hidden, writers).items():
            results[name if len(writers) == 1 else f"{name}, {writer}"] = figures
    return results


def bench(args: argparse.Namespace, work: str) -> None:
    px, model, optimizer = build(args.hidden, args.layers)
    train_step(model, optimizer, px, torch.randn(8, args.hidden))  # optimizer state exists
    mb = state_mb(model, optimizer)
    work_dir = Path(work)
    times = {} if args.only_in_flight else throughput(px, model, optimizer, work_dir, args.rounds)
    loop = (
        {}
        if args.only_in_flight
        else stall(px, model, optimizer, work_dir, args.rounds, args.steps, args.every, args.hidden)
    )
    flights = in_flight_report(px, model, optimizer, work_dir, args)
    if not px.is_main_process:
        return
    print(
        f"state: {mb:.0f} MB (model + AdamW), world_size={px.world_size}, rounds={args.rounds}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, the loop on {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS), load average {os.getloadavg()[0]:.1f}, "
        f"async shards written by the {args.writer} writer"
    )
    if times:
        print_throughput_and_stall(times, loop, mb, args)
    print("\nstep time while an async save is in flight / without one (the steps of about one save's length)")
    columns = list(flights)
    width = max(14, *(len(name) + 2 for name in columns))
    print(f"{'':26}" + "".join(f"{name:>{width}}" for name in columns))
    for key in flights[columns[0]]:
        print(f"{key:26}" + "".join(f"{flights[name][key]:{width}.3f}" for name in columns))


def print_throughput_and_stall(times: dict, loop: dict, mb: float, args: argparse.Namespace) -> None:
    print(f"{'':22}{'median s':>10}{'MB/s':>10}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:22}{med:10.3f}{mb / med:10.0f}")
    ratio = lambda a, b: statistics.median(times[a]) / statistics.median(times[b])  # noqa: E731
    print(
        f"phalanx save / torch.save+fsync time: {ratio('phalanx save', 'torch.save+fsync'):.2f}x; "
        f"phalanx load / torch.load time: {ratio('phalanx load', 'torch.load'):.2f}x"
    )
    print(f"\ntraining loop: {args.steps} steps, a save every {args.every}")
    for name, values in loop.items():
        print(f"{name:24}{statistics.median(values):10.3f} s")
    print(
        f"async stall / blocking stall: "
        f"{statistics.median(loop['async stall per save']) / statistics.median(loop['blocking stall per save']):.3f}x"
    )


def _rank_main(args: argparse.Namespace, work: str) -> None:
    bench(args, work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--no-s3", action="store_true", help="leave out the S3 column (moto's server)")
    parser.add_argument("--only-in-flight", action="store_true", help="only part 3 (the step time during a save)")
    parser.add_argument(
        "--writer",
        choices=["process", "thread", "both"],
        default="both",
        help="who writes an async save's shards: the helper process (phalanx's way), DCP's "
        "thread in the training process (before; for comparison), or both, round by round",
    )
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="phalanx-bench-ckpt-", dir=os.environ.get("BENCH_DIR"))
    try:
        with contextlib.ExitStack() as stack:
            if not args.no_s3:
                _start_s3(stack, Path(work))
            if args.world_size == 1:
                bench(args, work)
            else:
                from _spawn import spawn

                spawn(_rank_main, args.world_size, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _start_s3(stack: contextlib.ExitStack, work: Path) -> None:
    """moto's S3 server (the tests' fixture) for the S3 column; its AWS_* settings go to every rank."""
    try:
        import moto  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as error:
        print(f"(no S3 column: {error}; pip install -e '.[test]')")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.checkpoint.s3_server import s3_server

    (work / "moto").mkdir()
    server = stack.enter_context(s3_server(work / "moto"))
    # A real store runs elsewhere: moto's CPU time must not be charged to the training step here, so it
    # runs only on a core the loop leaves idle (SCHED_IDLE; nice 19 where that is not permitted).
    os.setpriority(os.PRIO_PROCESS, server.pid, 19)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(server.pid, os.SCHED_IDLE, os.sched_param(0))
    os.environ.update(server.env, BENCH_S3_URL=server.url("bench"))


if __name__ == "__main__":
    main()
