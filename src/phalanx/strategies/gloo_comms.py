"""FSDP2's gradient reduce-scatter as an all-reduce on gloo, where that is cheaper.

Measured on 2 CPU ranks (torch 2.13, 25 MB of fp32): gloo's reduce_scatter_tensor costs 17 ms of
CPU per call, its all_reduce 10 ms, although a reduce-scatter moves half the data. All-reducing
FSDP2's reduce-scatter input (laid out rank by rank) and keeping this rank's chunk gives the same
sums; it costs a transient full-size buffer that FSDP2 allocates anyway as that input.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

try:  # FSDP2's pluggable collectives (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2's own reduce-scatter stays
    ReduceScatter = None  # type: ignore[assignment,misc]

_PLAIN_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


if ReduceScatter is not None:
    class AllReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
        """reduce_scatter(output, input) computed as all_reduce(input) + this rank's chunk."""

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            if op not in _PLAIN_OPS:  # e.g. a pre-multiplied sum: leave it to the real reduce-scatter
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                                  async_op=async_op)
            dist.all_reduce(input_tensor, op=op, group=group)
            chunks = input_tensor.view(dist.get_world_size(group), -1)
            output_tensor.copy_(chunks[dist.get_rank(group)])
            return None


def use_all_reduce_for_gradients(modules: Iterable[Any], backend: str) -> bool:
    """On gloo, make each fully_shard-ed module reduce its gradients with AllReduceScatter."""
    if backend != "gloo" or ReduceScatter is None:
        return False
    comm = AllReduceScatter()
    for module in modules:
        module.set_custom_reduce_scatter(comm)
    return True
