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
    with pytest.raises(
        CheckpointWriteError,
        match=r"saving checkpoint step 2 to .*step-00000002 failed on rank 0: "
        r"OSError: \[Errno 5\] Input/output error; .*the latest good "
        r"checkpoint is step 1",
    ):
        step()
    assert px.global_step == 3
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000001"
    assert not (tmp_path / "ckpt" / "step-00000002").exists()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_failed_async_save_on_one_rank_is_reported_on_every_rank_at_the_next_step(tmp_path):
    """2 ranks: rank 1's shard of the async save of step 4 cannot be written (the storage fails in
    the background write); both ranks raise the same CheckpointWriteError, with the cause, at step 5,
    and `latest` stays on step 2 with nothing of step 4 left."""
    from tests.checkpoint.failing_async import FAILING_STEP
    from tests.dist.harness import run_ranks

    ckpt = tmp_path / "ckpt"
    results = run_ranks("tests.checkpoint.failing_async:run", 2, args=(str(ckpt),), timeout=240)
    for rank, seen in enumerate(results):
        assert seen["error"] is not None, f"rank {rank} trained on after the failed save: {seen}"
        assert seen["raised_at_step"] == FAILING_STEP + 1
        assert f"saving checkpoint step {FAILING_STEP} to {ckpt}/step-00000004 failed on rank" in seen["error"]
        assert "__1_0.distcp" in seen["error"] and "Is a directory" in seen["error"], seen["error"]
        assert "the latest good checkpoint is step 2" in seen["error"], seen["error"]
        assert seen["latest"] == "step-00000002"
        assert seen["entries"] == ["latest", "step-00000002"], seen["entries"]
    assert results[0]["error"] == results[1]["error"]


EXIT_WITH_A_SAVE_IN_FLIGHT = """
import atexit, os, sys, time
import torch
from torch import nn
from phalanx import Phalanx
from phalanx.checkpoint import writer_process

started = []
plain_init = writer_process.Helper.__init__
def counted(self):
    plain_init(self)
    started.append(self)
writer_process.Helper.__init__ = counted
plain_helper = writer_process.helper
def late():  # the save's thread reaches its write after the exit began (2 ranks plan with collectives first)
    time.sleep(0.5)
    return plain_helper()
writer_process.helper = late
# registered first, so it runs last: after phalanx's own exit hooks
atexit.register(lambda: print("helpers", len(started), [h.process.poll() for h in started], flush=True))
px = Phalanx(checkpoint_dir=sys.argv[1], checkpoint_async=True, preemption_signals="none")
model = nn.Linear(4, 2)
model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(2):
    optimizer.zero_grad()
    px.backward(model(torch.ones(3, 4)).sum())
    optimizer.step()
    px.save_state()  # the first is written while the second step runs; the second is in flight at exit
atexit._run_exitfuncs()  # how a worker forked by `phalanx run` ends (launch/worker.py), threads still running
os._exit(0)
"""


def test_the_exit_publishes_the_save_in_flight_with_the_helper_that_wrote_the_one_before(tmp_path):
    """The helper that writes async saves ends after the exit's wait for the last save, not before
    it: closed first, it was gone when that save reached its write, which then started a second
    helper (another torch import, seconds of the exit) that nothing closed."""
    import subprocess
    import sys

    script = tmp_path / "exit_in_flight.py"
    script.write_text(EXIT_WITH_A_SAVE_IN_FLIGHT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "helpers 1 [0]", proc.stdout + proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000002"
