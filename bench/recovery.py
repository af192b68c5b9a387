"""Recovery time: seconds from a rank's `kill -9` to the first completed step after the automatic restart.

A wine-sized model (13 -> 64 -> 3 MLP, Adam, 178 samples) trains on 2 processes under
`phalanx run --max-restarts 1 --checkpoint-dir ...`, saving every 5 steps. On the first attempt
rank 1 notes the time and kills itself with SIGKILL after step 12; the second attempt resumes from
step 10. Each rank of the second attempt notes when its script started, when `Phalanx()`
returned (process group joined), when `load_state()` returned and when its first step completed;
the figures are those times minus the kill time (the later rank's, as the job waits for both).
"first start" is the first attempt's: from the command's start to its first completed step.

Usage: python bench/recovery.py [--rounds 5] [--start-method fork|spawn] [--src LABEL=DIR ...]

`--src before=/tmp/base/src --src after=src` compares two phalanx source trees (each put first on
PYTHONPATH), alternating rounds so the machine's load hits both alike.

The command measured, once per round:
  phalanx run --nproc-per-node 2 --max-restarts 1 --checkpoint-dir CKPT WORKLOAD --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = """\
import json, os, signal, sys, time
started = time.time()
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from phalanx import Phalanx

out = sys.argv[sys.argv.index("--out") + 1]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
marks = {"attempt": attempt, "script_start": started}
px = Phalanx()
marks["phalanx_init"] = time.time()
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(178, 13, generator=g), torch.randint(0, 3, (178,), generator=g))
model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
loader = DataLoader(data, batch_size=16, shuffle=True)
model, optimizer, loader = px.prepare(model, optimizer, loader)
marks["prepared"] = time.time()
px.load_state()
marks["loaded"] = time.time()
marks["resumed_at"] = px.global_step
while px.global_step < 20:
    for x, y in loader:
        optimizer.zero_grad()
        px.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        if "first_step" not in marks:
            marks["first_step"] = time.time()
            with open(os.path.join(out, f"marks-{attempt}-{px.rank}.json"), "w") as f:
                json.dump(marks, f)
        if px.global_step % 5 == 0:
            px.save_state()
        if attempt == 0 and px.global_step == 12 and px.rank == 1:
            with open(os.path.join(out, "killed.json"), "w") as f:
                json.dump({"killed": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        if px.global_step >= 20:
            break
"""

MILESTONES = ("script_start", "phalanx_init", "loaded", "first_step")
FIRST_START = "first start"  # the command's start -> the first attempt's first completed step


def one_round(tmp: Path, start_method: str, src: str | None = None) -> dict[str, float]:
    """Run the job once; return kill -> milestone (seconds, the later rank) for the restarted attempt."""
    out = tmp / f"out-{time.monotonic_ns()}"
    out.mkdir()
    script = tmp / "workload.py"
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--start-method",
        start_method,
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--run-dir",
        str(out / "run"),
        str(script),
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    started = time.time()
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(src), env.get("PYTHONPATH")]))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    killed = json.loads((out / "killed.json").read_text())["killed"]
    ranks = [json.loads((out / f"marks-1-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["resumed_at"] == 10 for r in ranks), ranks
    first = max(json.loads((out / f"marks-0-{rank}.json").read_text())["first_step"] for rank in (0, 1))
    return {**{name: max(r[name] for r in ranks) - killed for name in MILESTONES}, FIRST_START: first - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--start-method", default="fork", choices=("fork", "spawn"))
    parser.add_argument(
        "--src",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a phalanx source tree to measure (repeat to compare; default: the installed one)",
    )
    args = parser.parse_args()
    trees = dict(item.split("=", 1) for item in args.src) or {"installed": ""}
    with tempfile.TemporaryDirectory(prefix="phalanx-recovery-") as name:
        tmp = Path(name)
        (tmp / "workload.py").write_text(WORKLOAD)
        for src in trees.values():
            one_round(tmp, args.start_method, src)  # warm the file cache; not counted
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
        for index in range(args.rounds):
            labels = list(trees) if index % 2 == 0 else list(reversed(trees))
            for label in labels:
                rounds[label].append(one_round(tmp, args.start_method, trees[label]))
    print(
        f"kill -9 of rank 1 -> milestone of the restarted attempt, seconds (median of {args.rounds}; "
        f"min-max), start method {args.start_method}, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"  {'milestone':<14}" + "".join(f"{label:>24}" for label in trees))
    for milestone in (*MILESTONES, FIRST_START):
        cells = []
        for label in trees:
            values = [r[milestone] for r in rounds[label]]
            cells.append(f"{statistics.median(values):8.2f} ({min(values):5.2f}-{max(values):5.2f})")
        print(f"  {milestone:<14}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
