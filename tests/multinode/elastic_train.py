"""The training script of the node-loss test: one script, any world size, the same global batch.

    phalanx run --split-batches --checkpoint-dir CKPT ... elastic_train.py --out OUT [--park 4:8,2:24]
    python elastic_train.py --out OUT            # the one-process reference

The DataLoader is built with the global batch (16) and `split_batches` divides it over however many
ranks run, so a checkpoint of 4 ranks continues on 2 and again on 4 with no change here. Every
few steps a checkpoint is saved. `--park WORLD:STEP,...`: a run of WORLD ranks that reaches STEP
(having started before it) saves there and waits, every rank, until the test writes OUT/go-WORLD-STEP
(each rank first writes OUT/parked-WORLD-STEP-RANK), so the test can take a node away or bring one
back at a known step. Rank 0 appends one JSON line per start to OUT/events.jsonl and saves the final
weights to OUT/final.pt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

NUM_SAMPLES = 256
GLOBAL_BATCH = 16  # 16 steps an epoch, on 1, 2 or 4 ranks alike
PARK_LIMIT_S = 300  # a parked rank gives up (and fails) after this: a test never hangs


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 3))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(NUM_SAMPLES, 13, generator=g), torch.randint(0, 3, (NUM_SAMPLES,), generator=g))


def park(px: Phalanx, out: Path, world: int, step: int) -> None:
    """Wait here, every rank, until the test says go (or give up after PARK_LIMIT_S)."""
    (out / f"parked-{world}-{step}-{px.rank}").write_text("")
    deadline = time.monotonic() + PARK_LIMIT_S
    with px.busy("parked by the test"):  # waiting on purpose: not a stall for the watchdog
        while not (out / f"go-{world}-{step}").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {px.rank}: parked at step {step} for {PARK_LIMIT_S} s, no go from the test")
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--park", default="", help="WORLD:STEP,... (see the module docstring)")
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep this long in each step (a slow job)")
    args = parser.parse_args()
    out = Path(args.out)
    parks = {tuple(int(v) for v in item.split(":")) for item in args.park.split(",") if item}
    torch.use_deterministic_algorithms(True)
    px = Phalanx()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(make_data(), batch_size=GLOBAL_BATCH, shuffle=True)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    checkpoints = px.config.checkpoint_dir is not None  # the reference runs without
    resumed = checkpoints and px.load_state()
    start = px.global_step
    if px.is_main_process:
        with open(out / "events.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {
                        "world_size": px.world_size,
                        "step": start,
                        "resumed": resumed,
                        "batch_per_rank": loader.batch_size,
                    }
                )
                + "\n"
            )
    while px.global_step < args.steps:
        for x, y in loader:
            optimizer.zero_grad()
            px.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            time.sleep(args.step_s)
            if checkpoints and px.global_step % args.every == 0:
                px.save_state()
            if (px.world_size, px.global_step) in parks and start < px.global_step:
                park(px, out, px.world_size, px.global_step)
            if px.global_step >= args.steps:
                break
    state = {k: v.detach().clone() for k, v in px.get_state_dict(model).items()}
    if px.is_main_process:
        torch.save(state, out / "final.pt")


if __name__ == "__main__":
    main()
