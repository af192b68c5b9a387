"""One short 2-rank job for the exit stress test, ending one way, started one way.

    phalanx run --nproc-per-node 2 exit_job.py MODE     (also torchrun, mpiexec -n 2)
    python exit_job.py MODE --mp-spawn                  (mp.spawn + the script's own group, adopted)
    python exit_job.py MODE --phalanx-spawn             (phalanx.spawn)

MODE: `normal` trains, gathers a metric and returns; `exception` trains, then rank 1 raises
mid-epoch and rank 0 fails in its next collective (what a crashing rank looks like to the others);
`preemption CKPT_DIR` trains with that checkpoint_dir and, at its second step, SIGTERM arrives as
a scheduler sends it: to `phalanx run` or torchrun (the workers' parent) when one started the ranks,
else to rank 0 itself; every rank then saves the step it is in and exits 143.
Every rank prints `exit-job rank R done` before it ends normally.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx import Phalanx

PLANNED = "planned failure of the exit stress test"


def _preempt() -> None:
    """SIGTERM where a scheduler sends it: the launcher (`phalanx run`, torchrun: this worker's
    parent, which forwards it to every worker), else this process."""
    launched_by_agent = "TORCHELASTIC_RUN_ID" in os.environ
    os.kill(os.getppid() if launched_by_agent else os.getpid(), signal.SIGTERM)


def job(mode: str, checkpoint_dir: str | None = None) -> int:
    px = Phalanx(checkpoint_dir=checkpoint_dir)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=4, shuffle=True)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    # preemption: long enough (30 epochs, 50 ms steps) for a rank that was not signalled to hear of
    # it from its peers (the watchdog polls once a second), as it would mid-training
    epochs = 30 if mode == "preemption" else 1
    for step, (x, y) in enumerate(batch for epoch in range(epochs) for batch in loader):
        optimizer.zero_grad()
        px.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        if mode == "exception" and step == 2 and px.rank == 1:
            raise RuntimeError(PLANNED)
        if mode == "preemption":
            time.sleep(0.05)
            if step == 1 and px.rank == 0:
                _preempt()
    total = px.reduce(torch.tensor([float(step)]), "sum")
    px.gather(total)
    print(f"exit-job rank {px.rank} done", flush=True)
    return px.rank


def _mp_spawn_worker(rank: int, mode: str, init_file: str, checkpoint_dir: str | None) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    job(mode, checkpoint_dir)
    dist.destroy_process_group()  # the script created the group, the script ends it


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode not in ("normal", "exception", "preemption"):
        raise SystemExit(f"exit_job.py: unknown mode {mode!r}")
    checkpoint_dir = argv[1] if mode == "preemption" else None
    if "--mp-spawn" in argv:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_mp_spawn_worker, args=(mode, os.path.join(tmp, "init"), checkpoint_dir), nprocs=2)
    elif "--phalanx-spawn" in argv:
        phalanx.spawn(job, mode, checkpoint_dir, nprocs=2)
    else:
        job(mode, checkpoint_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
