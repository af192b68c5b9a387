"""A 2-rank job whose storage starts failing mid-run under an async save (run by test_async_save.py).

The save of step 2 lands; for the async save of step 4, rank 1's shard cannot be written: a
directory already stands where its file `__1_0.distcp` goes (made after the staging directory, so
the failure is the storage's, in the background write). Each rank returns what it saw at its next step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from phalanx import Phalanx
from phalanx.checkpoint import dcp_storage
from phalanx.checkpoint.save_attempt import CheckpointWriteError

FAILING_STEP = 4


def _shard_blocked_on_rank1(px: Phalanx) -> None:
    plain_writer = dcp_storage.writer

    def writer(path, written=None, for_async=False):
        if px.rank == 1 and px.global_step == FAILING_STEP:
            os.mkdir(Path(path) / "__1_0.distcp")
        return plain_writer(path, written, for_async)

    dcp_storage.writer = writer


def run(ckpt: str) -> dict:
    px = Phalanx(checkpoint_dir=ckpt, checkpoint_async=True, preemption_signals="none")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    model, optimizer = px.prepare(model, torch.optim.AdamW(model.parameters()))

    def step() -> None:
        optimizer.zero_grad()
        px.backward(model(torch.ones(3, 8)).square().sum())
        optimizer.step()

    _shard_blocked_on_rank1(px)
    seen: dict = {"error": None}
    for _ in range(6):
        try:
            step()
        except CheckpointWriteError as error:
            seen.update(error=str(error), raised_at_step=px.global_step)
            break
        if px.global_step in (2, FAILING_STEP):
            px.save_state()
            pending = px._checkpointer._pending  # noqa: SLF001 - the test waits for the save to end, not to be raised
            while pending is not None and not pending.done():
                time.sleep(0.05)
    px.wait_for_everyone()
    root = Path(ckpt)
    seen.update(latest=(root / "latest").read_text().strip(), entries=sorted(p.name for p in root.iterdir()))
    return seen
