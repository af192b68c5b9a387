"""Async saves in a world of one (in this process): a save requested while one is in flight waits
for it and the log says so; the two never interleave; a failed one stops training at the next step
with its cause, and `latest` stays on the previous good checkpoint."""
from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

from phalanx import Phalanx
from phalanx.checkpoint import manager
from phalanx.checkpoint.save_attempt import CheckpointWriteError


def _trained(tmp_path):
    px = Phalanx(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_async=True, preemption_signals="none")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = px.prepare(model, optimizer)

    def step() -> None:
        optimizer.zero_grad()
        px.backward(model(torch.ones(3, 4)).sum())
        optimizer.step()

    return px, step


def test_a_save_requested_while_one_is_in_flight_waits_for_it_and_says_so(tmp_path, monkeypatch, caplog):
    finalize, order = manager.Checkpointer._finalize, []

    def slow_finalize(self, attempt, managed):
        order.append(("start", attempt.step))
        time.sleep(1.0)
        finalize(self, attempt, managed)
        order.append(("end", attempt.step))

    monkeypatch.setattr(manager.Checkpointer, "_finalize", slow_finalize)
    px, step = _trained(tmp_path)
    step()
    px.save_state()
    step()
    logger = logging.getLogger("phalanx")  # Phalanx() gave it its own handlers, not propagating to caplog's
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="phalanx"):
            px.save_state()
        px.wait_for_checkpoint()
    finally:
        logger.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if "waiting for the async save" in r.getMessage()]
    assert said == ["checkpoint of step 2: waiting for the async save of step 1, still being written"]
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000002"


def test_a_failed_async_save_stops_the_next_step_and_latest_stays(tmp_path, monkeypatch):
    px, step = _trained(tmp_path)
    step()
    px.save_state()
    px.wait_for_checkpoint()

    def failing_finalize(self, attempt, managed):
        attempt.run(lambda: (_ for _ in ()).throw(OSError(5, "Input/output error")))

    monkeypatch.setattr(manager.Checkpointer, "_finalize", failing_finalize)
    step()
    px.save_state()
    while px._checkpointer._pending is not None and not px._checkpointer._pending.done():  # noqa: SLF001
        time.sleep(0.05)
    with pytest.raises(CheckpointWriteError, match=r"saving checkpoint step 2 to .*step-00000002 failed on rank 0: "
                                                   r"OSError: \[Errno 5\] Input/output error; .*the latest good "
                                                   r"checkpoint is step 1"):
        step()
    assert px.global_step == 3
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000001"
    assert not (tmp_path / "ckpt" / "step-00000002").exists()
