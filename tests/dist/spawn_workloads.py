"""What every way of starting ranks runs (mp.spawn, phalanx.spawn, mpiexec): one short job that
reports the layout Phalanx() resolved, the data shard this rank saw and the strategy it chose."""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

NUM_SAMPLES = 10
PRINTED = "printed once by the main process"


def shard_report(run_exit_handlers: bool = False) -> dict:
    """Train one epoch of a tiny model; return what this rank saw and how it was set up.

    `run_exit_handlers`: run the atexit handlers before reporting, to see whether the process
    group survives them (phalanx must not destroy a group it did not create).
    """
    import torch.distributed as dist

    px = Phalanx()
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(NUM_SAMPLES)), batch_size=2, shuffle=True)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    seen: list[int] = []
    for (index,) in loader:
        seen += index.tolist()
        loss = model(index.float().unsqueeze(1)).pow(2).mean()
        px.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    px.print(PRINTED)
    sys.stdout.flush()
    if run_exit_handlers:
        atexit._run_exitfuncs()
    return {
        "rank": px.rank,
        "local_rank": px.local_rank,
        "world_size": px.world_size,
        "strategy": px.strategy_name,
        "seen": seen,
        "group_alive": dist.is_initialized(),
    }


def write_report(out_dir: str, report: dict) -> None:
    Path(out_dir, f"rank{report['rank']}.json").write_text(json.dumps(report))
