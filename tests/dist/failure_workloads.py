"""Rank functions that fail on purpose: a rank that raises, sleeps, dies or leaves its loop early."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx


def _setup(watchdog_timeout: float | None, **kwargs):
    px = Phalanx(strategy="ddp", watchdog_timeout=watchdog_timeout, **kwargs)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 3))
    model, optimizer, loader = px.prepare(model, optimizer, DataLoader(data, batch_size=4))
    return px, model, optimizer, loader


def misbehave_at_step_3(how: str, watchdog_timeout: float | None = None) -> None:
    """Train; at step 3, rank 1 raises / sleeps forever / SIGKILLs itself / leaves its loop."""
    px, model, optimizer, loader = _setup(watchdog_timeout)
    for step, (x,) in enumerate(loader):
        if px.rank == 1 and step == 3:
            time.sleep(1.5)  # some work in step 3 first (heartbeats are published once a second)
            print(f"rank 1: misbehaves ({how}) at step 3 at t={time.time():.3f}", flush=True)
            if how == "raise":
                raise ValueError("rank 1 fails on purpose at step 3")
            if how == "sleep":
                time.sleep(10**6)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "leave":
                break
        optimizer.zero_grad()
        px.backward(model(x).pow(2).mean())
        optimizer.step()
    print(f"rank {px.rank}: finished the loop", flush=True)


class _DiesWhenSaved:
    """Registered for checkpointing: rank 1 is SIGKILLed when a save asks for its state."""

    def state_dict(self) -> dict:
        if os.environ["RANK"] == "1":
            print(f"rank 1: killed inside its save at t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def killed_while_saving(checkpoint_dir: str, watchdog_timeout: float) -> None:
    """Train; right after step 3's optimizer step every rank saves, and rank 1 dies inside the save
    (no heartbeat comes between the step and the kill: the phase the peers read is the save's)."""
    px, model, optimizer, loader = _setup(watchdog_timeout)
    px.register_for_checkpointing(_DiesWhenSaved())
    for step, (x,) in enumerate(loader):
        optimizer.zero_grad()
        px.backward(model(x).pow(2).mean())
        optimizer.step()
        if step == 3:
            px.save_state(checkpoint_dir)


class StuckInRank1Worker(torch.utils.data.Dataset):
    """Rank 1's first DataLoader worker stops delivering at its 9th sample (in step 2 or 3): it
    blocks reading a pipe whose other end the rank and its workers hold, so it sleeps in the kernel
    the whole time, and ends once the watchdog has stopped the rank (and the other worker followed)."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()  # made before the workers fork: they inherit both

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        if os.environ["RANK"] == "1" and info.id == 0:
            self.loaded = getattr(self, "loaded", 0) + 1
            if self.loaded == 9:
                print(f"rank 1: worker 0 (pid {os.getpid()}) stops delivering", flush=True)
                os.close(self.write_end)
                os.read(self.read_end, 1)  # end of file once every other holder has exited
                os._exit(0)
        return torch.full((3,), float(i))


def stuck_loader_worker(watchdog_timeout: float) -> None:
    """Train with 2 DataLoader workers per rank until rank 1's first worker stops delivering."""
    px = Phalanx(strategy="ddp", watchdog_timeout=watchdog_timeout)
    model = nn.Linear(3, 1)
    model, optimizer, loader = px.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(StuckInRank1Worker(), batch_size=2, num_workers=2),
    )
    for x in loader:
        optimizer.zero_grad()
        px.backward(model(x).sum())
        optimizer.step()


def comm_hook_never_completes(seconds: float) -> None:
    """From step 1 on, a DDP comm hook whose future never completes: every rank waits in backward,
    where no collective timeout applies; the watchdog must end it after the collective + watchdog
    timeouts."""
    px = Phalanx(strategy="ddp", watchdog_timeout=2, collective_timeout=seconds)
    model = nn.Linear(3, 1)
    loader = DataLoader(TensorDataset(torch.randn(16, 3)), batch_size=4)
    model, optimizer, loader = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    calls = []

    def never_after_step_0(state, bucket):  # (no annotations: DDP checks them, and this module's are strings)
        calls.append(1)
        if len(calls) == 1:
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
        return torch.futures.Future()

    model.register_comm_hook(None, never_after_step_0)
    for step, (x,) in enumerate(loader):
        print(f"rank {px.rank}: step {step} at t={time.time():.3f}", flush=True)
        optimizer.zero_grad()
        px.backward(model(x).sum())
        optimizer.step()


def collective_timeout(seconds: float) -> None:
    """Watchdog off: rank 1 never reaches the barrier; rank 0's barrier must time out in `seconds`."""
    px = Phalanx(watchdog_timeout=0, collective_timeout=seconds)
    if px.rank == 1:
        time.sleep(seconds + 3)
        sys.exit(0)
    start = time.monotonic()
    try:
        px.wait_for_everyone()
    except RuntimeError as error:
        print(f"rank 0: barrier failed after {time.monotonic() - start:.1f} s: {error}", flush=True)
        raise


def debug_mismatch_and_busy_rank0() -> dict:
    """Debug mode: mismatched shapes, dtypes and collectives are reported by rank (caught here).

    Then rank 0 works for longer than the watchdog timeout inside main_process_first while rank 1
    waits: waiting on purpose is not a stall, so the job must finish.
    """
    px = Phalanx(debug=True, watchdog_timeout=2)
    r = px.rank
    errors = {}
    for name, call in {
        "reduce_shape": lambda: px.reduce(torch.ones(4 + r, 3)),
        "reduce_dtype": lambda: px.reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)),
        "gather_trailing": lambda: px.gather(torch.ones(2, 3 + r)),
        "different_ops": lambda: px.reduce(torch.ones(2)) if r == 0 else px.gather(torch.ones(2)),
        "barrier_vs_reduce": lambda: px.wait_for_everyone() if r == 0 else px.reduce(torch.ones(1)),
    }.items():
        try:
            call()
            errors[name] = None
        except RuntimeError as error:
            errors[name] = str(error)
    # Ragged dim 0 is legal for gather and must pass the check; the group must still work after.
    errors["gather_ragged_ok"] = px.gather(torch.ones(1 + r, 2)).shape
    errors["reduce_ok"] = px.reduce(torch.tensor([float(r)]), "sum").item()
    with px.main_process_first():
        if px.is_main_process:
            time.sleep(6)  # three watchdog timeouts
    errors["survived_busy_rank0"] = True
    return errors
