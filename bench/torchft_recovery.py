"""No-restart recovery with torchft, measured: a replica group dies, the other trains on, the dead one
rejoins and heals from its peer. Not a phalanx feature yet (see docs/preemption.md, "torchft").

    pip install --no-deps torchft      # 0.2.0 asks only torch>=2.7: it keeps the installed torch
    python bench/torchft_recovery.py [--steps 300]

Each replica group is `phalanx run --nproc-per-node 1` (a phalanx world of one: a prepared loader
over the group's share of the data, px.backward), with torchft's Manager, DistributedDataParallel
and Optimizer wired around the prepared objects in the script; a torchft LighthouseServer
(min_replicas=1) coordinates them. After 60 steps group 1's worker and launcher are killed with
SIGKILL; 8 s later group 1 is started again. Prints how long group 0 paused, how many steps it
trained alone, when group 1 rejoined, and whether both ended with equal weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP = """\
import json, os, sys, time
from datetime import timedelta
import torch
from torch import nn, optim
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from phalanx import Phalanx

group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
out, steps = sys.argv[1], int(sys.argv[2])
px = Phalanx(seed=0)
m = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
opt = optim.AdamW(m.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(960, 13, generator=g), torch.randint(0, 3, (960,), generator=g))
share = Subset(data, range(group, len(data), groups))  # this replica group's share of the data
m, opt, loader = px.prepare(m, opt, DataLoader(share, batch_size=16, shuffle=True))
pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
manager = Manager(pg=pg, min_replica_size=1, replica_id=f"px_{group}", timeout=timedelta(seconds=30),
                  state_dict=lambda: {"model": m.state_dict(), "optim": opt.state_dict()},
                  load_state_dict=lambda sd: (m.load_state_dict(sd["model"]), opt.load_state_dict(sd["optim"])),
                  checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
model = DistributedDataParallel(manager, m)
ft_opt = Optimizer(manager, opt)
open(os.path.join(out, f"pid{group}"), "w").write(str(os.getpid()))
log = open(os.path.join(out, f"group{group}.jsonl"), "a")
while manager.current_step() < steps:
    for x, y in loader:
        ft_opt.zero_grad()
        px.backward(nn.functional.cross_entropy(model(x), y))
        ft_opt.step()
        log.write(json.dumps({"t": time.time(), "step": manager.current_step(), "px_step": px.global_step,
                              "participants": manager.num_participants()}) + "\\n")
        log.flush()
        time.sleep(0.1)
        if manager.current_step() >= steps:
            break
torch.save(m.state_dict(), os.path.join(out, f"final{group}.pt"))
"""

LIGHTHOUSE = """\
import sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
print(server.address(), flush=True)
time.sleep(float(sys.argv[1]))
"""


def start_group(out: Path, group: int, lighthouse: str, steps: int) -> subprocess.Popen:
    env = dict(
        os.environ,
        REPLICA_GROUP_ID=str(group),
        NUM_REPLICA_GROUPS="2",
        TORCHFT_LIGHTHOUSE=lighthouse,
        OMP_NUM_THREADS="1",
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--nproc-per-node",
            "1",
            "--run-dir",
            str(out / f"run{group}-{time.monotonic_ns()}"),
            str(out / "group.py"),
            str(out),
            str(steps),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def rows(out: Path, group: int) -> list[dict]:
    path = out / f"group{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory(prefix="phalanx-torchft-") as name:
        out = Path(name)
        (out / "group.py").write_text(GROUP)
        (out / "lighthouse.py").write_text(LIGHTHOUSE)
        lighthouse = subprocess.Popen(
            [sys.executable, str(out / "lighthouse.py"), "900"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        address = lighthouse.stdout.readline().strip()
        try:
            groups = [start_group(out, g, address, args.steps) for g in (0, 1)]
            while len(rows(out, 1)) < 60:
                time.sleep(0.2)
            worker = int((out / "pid1").read_text())
            killed = time.time()
            os.kill(worker, signal.SIGKILL)
            groups[1].kill()  # its launcher too: the whole replica group is gone
            time.sleep(8)
            again = start_group(out, 1, address, args.steps)
            groups[0].wait(timeout=600)
            again.wait(timeout=600)
        finally:
            lighthouse.kill()
        zero = rows(out, 0)
        after = [r for r in zero if r["t"] > killed]
        pause = after[0]["t"] - max(r["t"] for r in zero if r["t"] <= killed)
        alone = [r["step"] for r in after if r["participants"] == 1]
        rejoined = next(r for r in rows(out, 1) if r["t"] > killed + 8)
        a, b = (torch.load(out / f"final{g}.pt") for g in (0, 1))
        equal = all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"group 1 killed at step {max(r['step'] for r in zero if r['t'] <= killed)}; group 0 paused {pause:.1f} s, "
        f"then trained alone for steps {alone[0]}-{alone[-1]}; group 1 rejoined "
        f"{rejoined['t'] - killed:.1f} s after the kill at step {rejoined['step']} (its px.global_step: "
        f"{rejoined['px_step']}); final weights equal: {equal}; load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
