"""Attention across a context-parallel cut equals one process's: outputs and q/k/v gradients, for
each mask (causal, packed documents, sliding window, padding) and both algorithms, on 2 gloo ranks."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from tests.dist import cp_workloads
from tests.dist.harness import run_ranks


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks("tests.dist.cp_workloads:attention_cases", world_size=2, timeout=180)


def naive(case: tuple) -> dict[str, torch.Tensor]:
    """The one-process reference, written out: softmax over the allowed keys of the whole sequence."""
    mask_name, _, heads, kv_heads = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mask_name, heads, kv_heads)).encode()))
    b, s, d = 2, 16, 8
    q, k, v, up = (
        torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]).expand(b, s, s).clone()
    fields = cp_workloads.batch_of(mask_name)
    if mask_name == "window":
        allowed &= i[:, None] - i[None, :] < 5
    if mask_name == "packed":
        pos = fields["position_ids"]
        doc = (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1)
        allowed &= doc[:, :, None] == doc[:, None, :]
    if mask_name == "padding":
        allowed &= fields["attention_mask"].bool()[:, None, :]
    rep = heads // kv_heads
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ kk.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.nan_to_num(F.softmax(scores, -1))  # a row that sees nothing: zeros
    out = probs @ vv
    out.backward(up)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("case", cp_workloads.CASES, ids=lambda c: "-".join(map(str, c)))
def test_one_process_path_equals_naive(case: tuple) -> None:
    got = cp_workloads.attention_case(*case, cp_size=1, cp_rank=0, group=None)
    want = naive(case)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", cp_workloads.CASES, ids=lambda c: "-".join(map(str, c)))
def test_cp2_equals_one_process(two_ranks: list[dict], case: tuple) -> None:
    want = naive(case)
    seen = torch.zeros(16, dtype=torch.bool)
    for rank in two_ranks:
        got = rank[case]
        index = got["index"]
        seen[index] = True
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], want[name][:, :, index], rtol=1e-10, atol=1e-12, msg=name)
    assert seen.all()  # the two ranks' tokens cover the sequence


def test_load_balanced_cut() -> None:
    from phalanx.strategies.context.layout import local_indices

    assert local_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 4"):
        local_indices(10, 2, 0)


def test_shard_sequence_pads_to_the_cut_and_keeps_positions_global() -> None:
    from phalanx.strategies.context import shard_sequence

    tokens = torch.arange(14).expand(2, 14)
    local, targets, layout = shard_sequence(
        {"input_ids": tokens}, tokens + 100, cp_size=2, cp_rank=1, pad=True, activate=False
    )
    assert layout.seq_len == 16 and layout.local.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert "attention_mask" not in local  # the layout carries it
    assert layout.key_padding[0].tolist() == [True] * 14 + [False] * 2 and layout.documents is None
    _, first, _ = shard_sequence({"input_ids": tokens}, tokens + 100, cp_size=2, cp_rank=0, pad=True, activate=False)
    assert first[0].tolist() == [100, 101, 102, 103, 112, 113, -100, -100]  # chunks 0 and 3: padding ignored
    with pytest.raises(ValueError, match="pass pad=True"):
        shard_sequence(tokens, cp_size=2, cp_rank=0, activate=False)
