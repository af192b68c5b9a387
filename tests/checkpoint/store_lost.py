"""A script that saves to S3, waits while the test stops the store, then saves again.

Rank 0 writes OUT/saved after the first save and every rank waits for OUT/stopped (the test's
signal that the store is down); the second save then meets the dead store. Each rank records the
error's text, its seconds and whether training state stayed as it was, trains one more step, then
raises the error again: it ends the script as it would a user's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from phalanx import Phalanx
from phalanx.checkpoint.save_attempt import CheckpointWriteError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    px = Phalanx()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)

    def step() -> None:
        loss = model(torch.ones(3, 4)).pow(2).mean()
        px.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        step()
    px.save_state()
    if px.rank == 0:
        (out / "saved").write_text("1")
    while not (out / "stopped").exists():
        time.sleep(0.1)
    step()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    started = time.monotonic()
    try:
        px.save_state()
    except CheckpointWriteError as error:
        seconds, text = time.monotonic() - started, str(error)
        intact = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        step_before = px.global_step
        step()  # training goes on after the refused save
        (out / f"rank{px.rank}.json").write_text(
            json.dumps(
                {"text": text, "seconds": seconds, "intact": intact, "step": step_before, "after": px.global_step}
            )
        )
        raise
    raise SystemExit("the save to a stopped store returned")


if __name__ == "__main__":
    main()
