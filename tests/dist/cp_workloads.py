"""Workloads for context parallel tests: run on each rank by tests.dist.harness."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from phalanx.strategies.context import attention as cp_attention
from phalanx.strategies.context import shard_sequence

MASKS = ("causal", "packed", "window", "padding")


def batch_of(mask: str, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """Inputs whose position_ids / attention_mask make `mask` (window is set at the call)."""
    fields = {"input_ids": torch.arange(batch * seq).reshape(batch, seq)}
    if mask == "packed":  # row 0: documents of 5, 7, 4 tokens; row 1: 9, 7
        fields["position_ids"] = torch.tensor([[*range(5), *range(7), *range(4)], [*range(9), *range(7)]])
    if mask == "padding":  # row 0 left-padded by 3, row 1 right-padded by 6
        fields["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
        fields["attention_mask"][0, :3] = 0
        fields["attention_mask"][1, -6:] = 0
    return fields


def attention_case(mask: str, algorithm: str, heads: int, kv_heads: int, cp_size: int, cp_rank: int,
                   group: object) -> dict[str, torch.Tensor]:
    """Output and q/k/v gradients of this rank's tokens (cp_size 1: the whole sequence)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mask, heads, kv_heads)).encode()))
    b, s, d = 2, 16, 8
    q = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv_heads, s, d, generator=gen, dtype=torch.float64)
    up = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    _, _, layout = shard_sequence(batch_of(mask), cp_size=cp_size, cp_rank=cp_rank, group=group, activate=False)
    index = layout.local
    q, k, v = (t[:, :, index].clone().requires_grad_() for t in (q, k, v))
    out = cp_attention(q, k, v, sliding_window=5 if mask == "window" else None, algorithm=algorithm, layout=layout)
    out.backward(up[:, :, index])
    return {"index": index, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


CASES = [(m, a, h, kv) for m in MASKS for a, h, kv in (("ulysses", 4, 2), ("allgather", 4, 1), ("allgather", 2, 2))]


def attention_cases() -> dict[tuple, dict[str, torch.Tensor]]:
    """Every case at cp = world size, in one launch."""
    dist.init_process_group("gloo")
    try:
        return {case: attention_case(*case, dist.get_world_size(), dist.get_rank(), None) for case in CASES}
    finally:
        dist.barrier()
        dist.destroy_process_group()
