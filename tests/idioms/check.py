"""How a cell of the idiom corpus is compared with one process: per-step loss and grad norm within
RTOL relative, final weights allclose (rtol RTOL, atol WEIGHTS_ATOL), item counts and `exact` values
equal. `outcome` says what a cell gave, in the terms of tests.idioms.table."""

from __future__ import annotations

from typing import Any

import torch

from tests.idioms.table import EQUAL, RTOL, WEIGHTS_ATOL, Refused


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def differences(ranks: list[dict], want: dict) -> list[str]:
    """What differs between a layout's ranks and one process (empty: equal)."""
    found: list[str] = []
    for what in ("losses", "norms"):
        for rank, got in enumerate(r[what] for r in ranks):
            if len(got) != len(want[what]):
                found.append(f"rank {rank} {what}: {len(got)} steps, one process {len(want[what])}")
                continue
            worst = max((_rel(g, w) for g, w in zip(got, want[what])), default=0.0)
            if worst > RTOL:
                found.append(f"rank {rank} {what} off by {worst:.3g}: {got} vs one process {want[what]}")
    items = {r["dp_rank"]: r["items"] for r in ranks}
    if sum(items.values()) != want["items"]:
        found.append(f"items {sum(items.values())} ({items} per data-parallel rank), one process {want['items']}")
    for rank, r in enumerate(ranks):
        if "exact" in want and r.get("exact") != want["exact"]:
            found.append(f"rank {rank}: {r.get('exact')} vs one process {want['exact']}")
    if "ids" in want:
        per_dp = {r["dp_rank"]: r["ids"] for r in ranks}
        union = [sorted(i for ids in per_dp.values() for i in ids[epoch]) for epoch in range(len(want["ids"]))]
        if union != want["ids"]:
            found.append(f"item ids read {union} vs one process {want['ids']}")
    state: dict[str, torch.Tensor] | None = None  # rank 0's, plus keys only other ranks hold (pp stages)
    for r in ranks:
        if "state" in r:
            state = {**r["state"], **(state or {})}
    ref = want.get("state")
    if ref is not None:
        if state is None or sorted(state) != sorted(ref):
            found.append(f"state keys {sorted(state or {})[:6]}... vs one process {sorted(ref)[:6]}...")
        else:
            worst = max(((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in ref.items())
            for key, value in ref.items():
                if not torch.allclose(state[key], value, rtol=RTOL, atol=WEIGHTS_ATOL):
                    found.append(f"weights off (worst tensor {worst:.3g} of its largest entry), first {key}")
                    break
    return found


def outcome(ranks: list[dict], want: dict | None) -> tuple[Any, str]:
    """(EQUAL, "") when the layout gave one process's result, Refused(message, "") when refused, else
    ("differs", what differs) or ("error", the error)."""
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return "error", errors[0][:600]
    refused = [r["refused"] for r in ranks if "refused" in r]
    if refused:
        return Refused(refused[0], ""), refused[0]
    assert want is not None, "no reference for a cell that ran"
    found = differences(ranks, want)
    return (EQUAL, "") if not found else ("differs", "; ".join(found)[:1200])
