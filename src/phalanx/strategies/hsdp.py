"""HSDP: hybrid sharding on FSDP2. Ranks form a 2-D mesh (replicate x shard): parameters, gradients
and optimizer state are sharded within a shard group (by default the processes of one node, over
the fast local links) and replicated across the groups, whose gradients are all-reduced (the slow
inter-node links carry one all-reduce of a shard instead of every all-gather and reduce-scatter).
"""
from __future__ import annotations

from typing import Any

from phalanx.runtime.context import DistContext
from phalanx.strategies.fsdp import FSDPStrategy


def mesh_shape(world_size: int, local_world_size: int, replicate_size: int | None = None,
               shard_size: int | None = None) -> tuple[int, int]:
    """(replicate, shard) sizes; by default one replica per node, sharded over its processes."""
    for name, value in (("replicate_size", replicate_size), ("shard_size", shard_size)):
        if value is not None and (int(value) != value or value < 1):
            raise ValueError(f"hsdp: strategy_options {name}={value!r} must be a positive integer")
    if shard_size is None:
        shard_size = world_size // replicate_size if replicate_size else max(local_world_size, 1)
    if replicate_size is None:
        replicate_size = world_size // shard_size if world_size % shard_size == 0 else 0
    if replicate_size * shard_size != world_size:
        raise ValueError(
            f"hsdp: a mesh of replicate_size={replicate_size} x shard_size={shard_size} does not cover "
            f"the {world_size} ranks (local world size {local_world_size}). HINT: set "
            "strategy_options={'replicate_size': R, 'shard_size': S} with R * S == world size.")
    return int(replicate_size), int(shard_size)


class HSDPStrategy(FSDPStrategy):
    """zero3 within each shard group, replicas across groups: FSDP2's `fully_shard(mesh=2-D)`."""

    name = "hsdp"

    def __init__(self, ctx: DistContext, options: Any = None):
        super().__init__(ctx, options)
        self.shape = mesh_shape(ctx.world_size, ctx.local_world_size, self.options.replicate_size,
                                self.options.shard_size)

    def device_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.ctx.device.type, self.shape, mesh_dim_names=("replicate", "shard"))
