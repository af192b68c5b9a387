"""Start-up time: command -> a no-op 2-process job has initialised its process group and exited.

Compares, in alternating rounds (so machine load hits all alike):
  torchrun        python -m torch.distributed.run --nproc-per-node 2 noop.py
  phalanx fork    python -m phalanx run --nproc-per-node 2 noop.py   (default on CPU)
  phalanx spawn   python -m phalanx run --start-method spawn ...       (torchrun-like fresh workers)
and, as the yardstick, one bare `python -c "import torch"`.

Usage: python bench/startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

NOOP_WORKER = """\
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def time_command(command: list[str]) -> float:
    """Wall seconds for `command`, which must succeed."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "noop.py")
        with open(script, "w") as fp:
            fp.write(NOOP_WORKER)
        python = sys.executable
        commands = {
            "import torch": [python, "-c", "import torch"],
            "torchrun": [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", script],
            "phalanx fork": [python, "-m", "phalanx", "run", "--nproc-per-node", "2", script],
            "phalanx spawn": [
                python,
                "-m",
                "phalanx",
                "run",
                "--start-method",
                "spawn",
                "--nproc-per-node",
                "2",
                script,
            ],
        }
        for command in commands.values():  # warm the file cache; not counted
            time_command(command)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for round_index in range(args.rounds):
            order = list(commands) if round_index % 2 == 0 else list(reversed(commands))
            for name in order:
                times[name].append(time_command(commands[name]))
    print(f"{'command':<15}{'mean s':>9}{'stdev':>8}{'x import torch':>16}{'x torchrun':>12}   ({args.rounds} rounds)")
    base = statistics.mean(times["import torch"])
    torchrun = statistics.mean(times["torchrun"])
    for name, values in times.items():
        mean = statistics.mean(values)
        stdev = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{name:<15}{mean:>9.2f}{stdev:>8.2f}{mean / base:>16.2f}{mean / torchrun:>12.2f}")
    print(f"phalanx fork / torchrun = {statistics.mean(times['phalanx fork']) / torchrun:.2f}")


if __name__ == "__main__":
    main()
