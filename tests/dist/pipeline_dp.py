"""Data parallelism inside each pipeline stage, for the tests that drive the runner by hand: DDP or
FSDP2 over the data-parallel group/mesh. (Phalanx itself wraps stages in `parallelize`, with its own
options and mixed precision; this was strategies/pipeline/data_parallel.py, which nothing in phalanx
used.)

The stage modules, not the whole model, are wrapped: each stage's gradients are reduced over the
ranks that hold the same stage (the data-parallel submesh at this pipeline rank). torch's
`PipelineStage` knows both wrappers: under DDP it runs every microbatch but the last under
`no_sync()` and reduces on the last; under FSDP2 it turns gradient sync and resharding off for the
microbatches and reduce-scatters once after them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from phalanx.strategies.pipeline.cut import RankStages


def _has_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def apply_ddp(rank: RankStages, dp_group: Any, **ddp_kwargs: Any) -> tuple[nn.Module, ...]:
    """Each stage module in DDP over `dp_group` (a ProcessGroup or a 1-D mesh); the modules to run.

    The rank's model itself stays unwrapped: its state dict and parameters keep their names.
    `find_unused_parameters` defaults to True: with False, the first new input shape after a step
    (a short batch, an accumulation micro-step) fails in DDP's reducer ("rebuilt parameter indices
    size is not same as original model parameters size", 13 versus 26 on the tests' stage). Our reading:
    torch's shape inference runs one DDP forward outside `no_sync`, which arms the reducer's hooks, and the
    microbatches run under `no_sync` then fire them: the reducer records the parameter order twice
    and asserts when it rebuilds its buckets at the next such forward. With unused parameters looked
    for, it never rebuilds them; the cost is one walk of the autograd graph per step."""
    from torch.nn.parallel import DistributedDataParallel

    group = dp_group.get_group() if hasattr(dp_group, "get_group") else dp_group
    ddp_kwargs.setdefault("find_unused_parameters", True)
    return tuple(
        DistributedDataParallel(m, process_group=group, **ddp_kwargs) if _has_params(m) else m for m in rank.stages
    )


def apply_fsdp(
    rank: RankStages, dp_mesh: Any, *, reshard_after_forward: bool = False, **fsdp_kwargs: Any
) -> tuple[nn.Module, ...]:
    """FSDP2 over `dp_mesh`: each unit of this rank (block, embedding, head) sharded on its own, each
    stage module the root over what is left.

    `reshard_after_forward` defaults to False as torchtitan does under pp: a stage runs forward once
    per microbatch, and freeing its parameters after each would all-gather them again for every
    microbatch's backward. Parameters are sharded between steps either way."""
    from torch.distributed.fsdp import fully_shard

    blocks = [rank.model.get_submodule(n) for n in rank.units]
    for block in blocks:
        if _has_params(block):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    for stage in rank.stages:
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    return rank.stages
