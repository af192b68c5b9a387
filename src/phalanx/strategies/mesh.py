"""The one DeviceMesh of a job: named dims (pp, dp_replicate, dp_shard, tp), outermost first, built
from the parallel plan on every rank together. Every layout's groups are slices of it."""
from __future__ import annotations

from typing import Any

from phalanx.strategies.parallel_plan import ParallelPlan


def build_mesh(plan: ParallelPlan, device_type: str) -> Any:
    """The mesh of `plan` on `device_type`; None in a world of one (nothing to lay out)."""
    if not plan.is_distributed:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    degrees = plan.degrees()
    return init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))
