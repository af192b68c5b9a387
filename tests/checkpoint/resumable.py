"""A deterministic training script that checkpoints every few steps and resumes by itself.

Run by the tests on N ranks, through the test harness (`run`) or a launcher with restarts
(`python resumable.py --ckpt DIR --out DIR ...`). `kills` makes chosen attempts die by SIGKILL:
"12:1,20s:0" = on the first attempt rank 1 dies after step 12; on the second, rank 0 dies inside
the save of step 20 (its shard written, the manifest not yet). Rank 0 appends one JSON line per
event to OUT/events.jsonl and saves the final parameters to OUT/final.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx
from phalanx.checkpoint.manager import Checkpointer, CheckpointFallbackWarning

NUM_SAMPLES = 48  # with a global batch of 12: 4 steps per epoch, on 1, 2 or 3 ranks alike


def make_model(dropout: float = 0.2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 3))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(NUM_SAMPLES, 13, generator=g),
        torch.randint(0, 3, (NUM_SAMPLES,), generator=g),
        torch.arange(NUM_SAMPLES),
    )


def parse_kills(text: str) -> dict[int, tuple[int, bool, int]]:
    """attempt -> (step, during_save, rank)."""
    kills = {}
    for attempt, item in enumerate(filter(None, text.split(","))):
        step, rank = item.split(":")
        kills[attempt] = (int(step.rstrip("s")), step.endswith("s"), int(rank))
    return kills


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def build(px: Phalanx, global_batch: int = 12, dropout: float = 0.2) -> tuple:
    """Model, optimizer, loader and scheduler, prepared; then per-rank RNG streams."""
    model = make_model(dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    # split_batches: the script names the global batch and phalanx divides it; else the script does.
    per_loader = global_batch if px.config.split_batches else global_batch // px.world_size
    loader = DataLoader(make_data(), batch_size=per_loader, shuffle=True)
    prepared = px.prepare(model, optimizer, loader, scheduler)
    # Different streams per rank (as real scripts have): restoring the right one to each rank matters.
    torch.manual_seed(100 + px.rank)
    np.random.seed(100 + px.rank)
    random.seed(100 + px.rank)
    return prepared


def load_report(root: str) -> dict:
    """Load the latest good checkpoint under `root`; report what was loaded and what was skipped."""
    px = Phalanx(checkpoint_dir=root)
    build(px)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = px.load_state()
    return {
        "loaded": loaded,
        "step": px.global_step,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CheckpointFallbackWarning)],
    }


class SlowState:
    """Registered state whose state_dict takes 3 s once `slow` is true (a save long enough to signal into)."""

    def __init__(self, out: str):
        self.out, self.slow = Path(out), False

    def state_dict(self) -> dict:
        if self.slow:
            (self.out / "saving").write_text("1")
            time.sleep(3.0)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def fill_filesystem(directory: Path) -> None:
    """Fill the filesystem holding `directory` (a small tmpfs in the tests) to the last byte."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:  # ENOSPC: on to smaller writes, then done
                pass
    finally:
        os.close(fd)


def run(
    ckpt: str | None,
    out: str,
    steps: int = 40,
    every: int = 5,
    global_batch: int = 12,
    kills: str = "",
    async_save: bool = False,
    keep: int = 0,
    noise: bool = True,
    slow_from: int | None = None,
    slow_save: bool = False,
    fill_after: int | None = None,
    split_batches: bool = False,
) -> dict:
    """Train to `steps`; `noise=False` drops dropout and RNG terms (for runs on other world sizes);
    `split_batches`: the loader is built with the global batch (else with global_batch / world size).

    `slow_from`: from that step on, each rank writes OUT/pid-RANK and rank 0 OUT/slow (a test sends
    its signal then), and every step takes 0.2 s longer, so a signal lands mid-training.
    `slow_save`: saves after `slow_from` take 3 s more (OUT/saving marks their start).
    `fill_after`: after the save of that step, rank 0 fills the checkpoint directory's filesystem."""
    dropout = 0.2 if noise else 0.0
    torch.use_deterministic_algorithms(True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    px = Phalanx(
        checkpoint_dir=ckpt, checkpoint_keep=keep, checkpoint_async=async_save, split_batches=split_batches or None
    )
    kill = parse_kills(kills).get(attempt)
    if kill and kill[1] and kill[2] == px.rank:
        finalize = Checkpointer._finalize

        def finalize_or_die(self, attempt, managed):
            if attempt.step == kill[0]:
                _die()
            return finalize(self, attempt, managed)

        Checkpointer._finalize = finalize_or_die  # type: ignore[method-assign]
    model, optimizer, loader, scheduler = build(px, global_batch, dropout)
    slow_state = SlowState(out)
    if slow_save:
        px.register_for_checkpointing(slow_state)
    records = []

    def record(event: dict) -> None:
        event = {"attempt": attempt, "world_size": px.world_size, "strategy": px.strategy_name, **event}
        records.append(event)
        if px.is_main_process:
            with open(Path(out) / "events.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")

    record({"event": "resumed" if px.load_state() else "started", "step": px.global_step})
    while px.global_step < steps:
        for x, y, idx in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if noise:
                loss = loss + 1e-3 * float(np.random.rand()) + 1e-3 * random.random()
            px.backward(loss)
            optimizer.step()
            scheduler.step()
            record(
                {
                    "event": "step",
                    "step": px.global_step,
                    "loss": px.reduce(loss.detach(), "mean").item(),
                    "indices": px.gather(idx).tolist(),
                }
            )
            if px.global_step % every == 0:
                px.save_state()
                if fill_after == px.global_step and px.is_main_process:
                    px.wait_for_checkpoint()  # an async save of this step must land before the disk is full
                    fill_filesystem(Path(px.config.checkpoint_dir))
            if kill and not kill[1] and kill[0] == px.global_step and kill[2] == px.rank:
                _die()
            if slow_from is not None and px.global_step >= slow_from:
                if px.global_step == slow_from:
                    (Path(out) / f"pid-{px.rank}").write_text(str(os.getpid()))
                    if px.is_main_process:
                        (Path(out) / "slow").write_text(str(px.global_step))
                slow_state.slow = True
                time.sleep(0.2)
            if px.global_step >= steps:
                break
    # No wait_for_checkpoint(): an async save still in flight must be finished by the exit itself.
    state = {k: v.detach().clone() for k, v in px.get_state_dict(model).items()}  # full weights, any strategy
    if px.is_main_process:
        torch.save(state, Path(out) / "final.pt")
    return {"records": records, "state": state, "strategy": px.strategy_name}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default=None, help="default: phalanx run --checkpoint-dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kills", default="")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--keep", type=int, default=0, help="checkpoint_keep (0 keeps all)")
    parser.add_argument("--slow-from", type=int, default=None, help="from this step on, 0.2 s more per step")
    parser.add_argument("--slow-save", action="store_true", help="saves after --slow-from take 3 s more")
    parser.add_argument("--fill-after", type=int, default=None, help="fill the checkpoint filesystem after this save")
    args = parser.parse_args()
    run(
        args.ckpt,
        args.out,
        args.steps,
        args.every,
        kills=args.kills,
        async_save=args.async_save,
        keep=args.keep,
        slow_from=args.slow_from,
        slow_save=args.slow_save,
        fill_after=args.fill_after,
    )


if __name__ == "__main__":
    main()
