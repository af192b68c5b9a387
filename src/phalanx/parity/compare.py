"""`phalanx parity`'s verdict: two runs' per-step records compared, a table, and the likely causes.

Pure functions over the JSON lines the workers wrote (runtime/parity_record.py); no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

ATOL = 1e-6  # below this, absolute differences are float noise whatever the relative one


@dataclass(frozen=True)
class Records:
    """One run's lines: the steps in order and the end line (None when the run was stopped at K)."""

    steps: list[dict[str, Any]]
    end: dict[str, Any] | None
    found: bool  # the file exists: the script created a Phalanx()


def read_records(path: str) -> Records:
    if not os.path.exists(path):
        return Records([], None, False)
    steps, end = [], None
    with open(path, encoding="utf-8") as fp:
        for line in fp:
            if line.strip():
                row = json.loads(line)
                if row.get("end"):
                    end = row
                else:
                    steps.append(row)
    return Records(steps, end, True)


def shortfall(records: Records, steps: int, script: str) -> str | None:
    """Why a run cannot be compared (never called px.backward, fewer steps than asked), or None."""
    if not records.found or (not records.steps and (records.end is None or records.end["backward_calls"] == 0)):
        return (
            f"{script} never called px.backward, so there is nothing to compare: parity records the loss "
            "px.backward receives and the gradient norm before each optimizer step. HINT: train with "
            "px.backward(loss) and an optimizer prepared by px.prepare"
        )
    if len(records.steps) < steps:
        took = len(records.steps)
        return (
            f"{script} took only {took} optimizer step{'s' if took != 1 else ''} "
            f"(px.backward was called {records.end['backward_calls'] if records.end else '?'} times), fewer than "
            f"--steps {steps}. HINT: pass --steps {max(took, 1)}, or give the script more data or steps"
        )
    return None


def differs(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) > rtol * abs(a) + ATOL


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def first_difference(one: list[dict[str, Any]], many: list[dict[str, Any]], rtol: float) -> int | None:
    """Index of the first step whose loss or gradient norm differs beyond the tolerance."""
    for i, (a, b) in enumerate(zip(one, many)):
        if differs(a["loss"], b["loss"], rtol) or differs(a["grad_norm"], b["grad_norm"], rtol):
            return i
    return None


def table(one: list[dict[str, Any]], many: list[dict[str, Any]], world_size: int, rtol: float) -> str:
    procs = f"{world_size} procs"
    header = (
        f"{'step':>5}  {'loss 1 proc':>14}  {'loss ' + procs:>14}  {'rel diff':>9}  "
        f"{'grad norm 1 proc':>16}  {'grad norm ' + procs:>16}  {'rel diff':>9}"
    )
    lines = [header]
    for a, b in zip(one, many):
        mark = (
            "  <- differs"
            if differs(a["loss"], b["loss"], rtol) or differs(a["grad_norm"], b["grad_norm"], rtol)
            else ""
        )
        lines.append(
            f"{a['step']:>5}  {a['loss']:>14.8g}  {b['loss']:>14.8g}  {relative(a['loss'], b['loss']):>9.2e}  "
            f"{a['grad_norm']:>16.8g}  {b['grad_norm']:>16.8g}  "
            f"{relative(a['grad_norm'], b['grad_norm']):>9.2e}{mark}"
        )
    return "\n".join(lines)


def _near(ratio: float, target: float) -> bool:
    return abs(ratio - target) <= 0.05 * target


def likely_causes(one: dict[str, Any], many: dict[str, Any], many_steps: list[dict[str, Any]]) -> list[str]:
    """What the records show that makes N processes train unlike one, at the first differing step."""
    world = many["world_size"]
    causes = []
    ones, manys = one.get("global_batch"), many.get("global_batch")
    if ones and manys and ones != manys:
        causes.append(
            f"the global batches differ: {ones} samples per step in the one-process run against {manys} on {world} "
            f"processes, so the two runs cannot agree. The one-process run takes the per-process batch x {world}; a "
            "script that sets its batch size from px.dp_size or px.world_size (global // px.dp_size) shrinks it "
            "with the world size. HINT: keep the per-process batch size fixed, or prepare the loader with "
            "split_batches=True (its batch_size is then the global batch, the same in both runs)"
        )
    if many["unsynced_batchnorm"]:
        names = ", ".join(many["unsynced_batchnorm"][:6]) + (", ..." if len(many["unsynced_batchnorm"]) > 6 else "")
        causes.append(
            f"BatchNorm layers without SyncBatchNorm ({names}): each process normalises with the statistics "
            f"of its own 1/{world} of the batch. HINT: --sync-batchnorm (Phalanx(sync_batchnorm=True))"
        )
    for what, key in (("loss", "loss"), ("gradient norm", "grad_norm")):
        if one[key] and many[key]:
            ratio = many[key] / one[key]
            if _near(ratio, world) or _near(ratio, 1 / world):
                causes.append(
                    f"a {what} that scales with the world size: {ratio:.3g} x the one-process {what} on {world} "
                    "processes. HINT: do not multiply or divide the loss by px.world_size (phalanx averages "
                    "gradients over the processes) and do not sum gradients across processes yourself"
                )
                break
    if many["prepared_loaders"] == 0:
        causes.append(
            "no DataLoader was prepared (px.prepare(loader)): every process reads the whole data set, "
            "and the one-process run's batch is not the global batch. HINT: px.prepare(model, optimizer, "
            "loader)"
        )
    elif world > 1 and all(len(set(s["rank_losses"])) == 1 for s in many_steps):
        causes.append(
            f"every process computed the same loss at every step: the {world} processes read the same "
            "batches (a loader prepared with shard=False over data that is not split per rank?)"
        )
    if len(set(many["seeds"])) > 1 or len(set(many["rng"])) > 1:
        seeds = ", ".join(f"rank {r}: {s}" for r, s in enumerate(many["seeds"]))
        causes.append(
            f"randomness seeded per rank (torch's seed {seeds}): random numbers drawn in the loop "
            "(augmentation, noise, initialisation) differ from the one-process run. HINT: seed every "
            "rank alike, e.g. Phalanx(seed=...), not seed + rank"
        )
    return causes
