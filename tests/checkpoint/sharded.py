"""FSDP2 (`fully_shard`, what zero3 uses) through the checkpointer: saved sharded on 2 ranks, loaded
into a plain model in one process. phalanx has no zero3 strategy on main yet, so this shards the
model by hand and tracks it the way a strategy's prepare does."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from phalanx import Phalanx
from tests.checkpoint.resumable import make_data, make_model


def train_a_little(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> None:
    data = make_data()
    for step in range(3):
        x, y, _ = data[step * 12 + rank * (12 // world) : step * 12 + (rank + 1) * (12 // world)]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def save_fsdp(path: str) -> dict:
    torch.use_deterministic_algorithms(True)
    px = Phalanx()
    mesh = init_device_mesh("cpu", (px.world_size,))
    model = make_model(0.0)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    px._checkpointer.strategy_name = "zero3"
    px._checkpointer.track(model)
    px._checkpointer.track(optimizer)
    train_a_little(model, optimizer, px.rank, px.world_size)
    px.save_state(path)
    local_shapes = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"params": full, "optim_state": optim["state"], "local_shapes": local_shapes, "global_step": px.global_step}
