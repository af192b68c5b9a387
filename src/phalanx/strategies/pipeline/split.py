"""Which units each pipeline stage owns: contiguous runs of the model's chain of units.

By default the cut points sit before blocks and are chosen to make the stages even by parameter
count, with what comes before the first block on the first stage and what comes after the last on
the last stage (torchtitan's cut of Llama): the largest stage holds as few parameters as any cut
allows. `pp_split` names the units to cut before instead (`["layers.4"]` for two stages).
"""

from __future__ import annotations

from typing import Sequence

from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import schedules
from phalanx.strategies.pipeline.chain import ModelChain

Stages = tuple[tuple[str, ...], ...]
"""Per stage, the names of the units it owns, in call order."""


def _named_cuts(chain: ModelChain, num_stages: int, pp_split: Sequence[str]) -> list[int]:
    names = chain.names
    split = list(pp_split)
    if len(split) != num_stages - 1:
        raise ValueError(
            f"pp_split names {len(split)} cut point(s) {split}, which makes {len(split) + 1} stage(s), but "
            f"pp={num_stages}. HINT: name pp - 1 = {num_stages - 1} unit(s) to cut before, from: {chain.describe()}"
        )
    positions = []
    for name in split:
        if name not in names:
            raise ValueError(
                f"pp_split names {name!r}, which is not a unit the pipeline can cut before. The units, in the "
                f"order forward calls them, are: {chain.describe()}"
            )
        positions.append(names.index(name))
    if positions and positions[0] == 0:
        raise ValueError(f"pp_split cannot cut before {names[0]!r}, the first unit: the first stage would be empty.")
    if any(b <= a for a, b in zip(positions, positions[1:])):
        raise ValueError(
            f"pp_split {split} is not in the order forward calls the units ({chain.describe()}). HINT: list "
            "each cut point once, earliest first."
        )
    return positions


def _even_cuts(chain: ModelChain, num_stages: int) -> list[int]:
    """Cut points before blocks minimising the largest stage's parameter count (then the spread)."""
    blocks = [i for i, u in enumerate(chain.units) if u.is_block]
    if num_stages > len(blocks):
        raise ValueError(
            f"pp={num_stages} needs at least {num_stages} blocks to give each stage one, but "
            f"{chain.blocks or 'the model'} holds {len(blocks)}. HINT: lower pp to at most {len(blocks)}, or "
            "name the cut points with pp_split."
        )
    weights = [u.num_params for u in chain.units]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    n = len(weights)
    cands = blocks[1:]  # a stage may start at any block but the first

    def seg(a: int, b: int) -> int:
        return prefix[b] - prefix[a]

    def add(cost: tuple[int, int], w: int) -> tuple[int, int]:
        return max(cost[0], w), cost[1] + w * w

    if num_stages == 1:
        return []
    # best[t]: (cost, cuts) of the stages so far, the last of them ending just before cands[t]
    best: list[tuple[tuple[int, int], list[int]] | None] = [((seg(0, c), seg(0, c) ** 2), []) for c in cands]
    for _ in range(num_stages - 2):
        nxt: list[tuple[tuple[int, int], list[int]] | None] = [None] * len(cands)
        for t, end in enumerate(cands):
            for s in range(t):
                prev = best[s]
                if prev is None:
                    continue
                cost = add(prev[0], seg(cands[s], end))
                if nxt[t] is None or cost < nxt[t][0]:  # type: ignore[index]
                    nxt[t] = (cost, prev[1] + [cands[s]])
        best = nxt
    final = None
    for t, start in enumerate(cands):
        if best[t] is None:
            continue
        cost = add(best[t][0], seg(start, n))  # type: ignore[index]
        if final is None or cost < final[0]:
            final = (cost, best[t][1] + [start])  # type: ignore[index]
    assert final is not None  # noqa: S101 - len(cands) >= num_stages - 1 was checked above
    return final[1]


def split_stages(chain: ModelChain, num_stages: int, pp_split: Sequence[str] | None = None) -> Stages:
    """The units of each of `num_stages` stages; `pp_split` names the units to cut before."""
    if int(num_stages) != num_stages or num_stages < 1:
        raise ValueError(f"pp must be a positive integer, got {num_stages!r}")
    cuts = _named_cuts(chain, num_stages, pp_split) if pp_split else _even_cuts(chain, num_stages)
    bounds = [0, *cuts, len(chain.units)]
    names = chain.names
    return tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:]))


def split_for_schedule(
    chain: ModelChain, plan: ParallelPlan, schedule: str, pp_split: Sequence[str] | None = None
) -> Stages:
    """The stages of the plan's pipeline ranks under `schedule` (pp x its stages per rank)."""
    pp = plan.pp
    per_rank = schedules.stages_per_rank(schedule)
    try:
        return split_stages(chain, pp * per_rank, pp_split)
    except ValueError as error:
        if per_rank == 1:
            raise
        raise ValueError(
            f"pp={pp} with pp_schedule={schedules.schedule_name(schedule)} runs {per_rank} stages per "
            f"pipeline rank, {pp * per_rank} in all: {error}"
        ) from None


def stage_params(chain: ModelChain, stages: Stages) -> list[int]:
    """Parameters (elements) each stage holds."""
    counts = {u.name: u.num_params for u in chain.units}
    return [sum(counts[n] for n in stage) for stage in stages]
