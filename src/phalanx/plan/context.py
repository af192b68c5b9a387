"""`phalanx plan --cp N`: the figures of one context-parallel rank, which holds 1/N of every row.

Parameters, gradients and optimizer state are sharded (or replicated) over the data-parallel and cp
ranks together, so the strategies' columns are unchanged; the activations are measured on one
rank's part of the batch (`--input BxS` becomes `Bx(S/N)`)."""

from __future__ import annotations

import argparse
from typing import Any


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each row's sequence cut over cp ranks; with --input BxS the "
        "activations are one rank's part, B x S/cp (default 1)",
    )


def cut_input(args: argparse.Namespace) -> str:
    """Check --cp against the layout and turn --input into one cp rank's part; the line to print
    under the table ('' without cp). ValueError with the fix."""
    from phalanx.strategies.plan import presets

    cp = args.cp
    if cp == 1:
        return ""
    presets.check_flags(args.world_size, args.tp, args.pp, cp)
    if args.pp > 1:
        raise ValueError(
            f"--cp {cp} with --pp {args.pp}: context parallel is not composed with pipeline stages. HINT: use --pp 1"
        )
    plan = presets.build(
        presets.AUTO_CHOOSES[0],
        presets.asking(tp=args.tp, cp=cp),
        world_size=args.world_size,
        local_world_size=args.nproc_per_node or args.world_size,
    )
    if args.input is None:
        return f"context parallel: cp {cp}, each rank holds 1/{cp} of every row (give --input BxS for its activations)"
    shape_text, sep, dtype = args.input.partition(":")
    dims = shape_text.lower().split("x")
    if len(dims) < 2 or not dims[1].isdigit() or int(dims[1]) % plan.cp_chunks:
        raise ValueError(
            f"--input {args.input!r} with --cp {cp}: the sequence (the second dim) must cut into 2 x cp = "
            f"{plan.cp_chunks} equal chunks. HINT: a sequence length that is a multiple of {plan.cp_chunks}"
        )
    seq = int(dims[1])
    dims[1] = str(seq // cp)
    args.input = "x".join(dims) + sep + dtype
    return (
        f"context parallel: cp {cp}, each rank holds {seq // cp} of every row's {seq} tokens: the activations "
        f"above are one rank's ({args.input}); data-parallel ranks {plan.dp_size}"
    )


def longest_sequence(model: Any, args: argparse.Namespace, sizes: list, optimizer: str, budget: int) -> str:
    """The longest row (a multiple of 2 x cp tokens, at --input's batch) whose one-cp-rank activations
    and zero3's model state fit `budget` per rank, beside cp 1's: a line for the report ('' without
    cp or --input)."""
    if args.cp == 1 or args.input is None:
        return ""
    at_cp = _longest(model, args, sizes, optimizer, budget, args.cp)
    alone = _longest(model, args, sizes, optimizer, budget, 1)
    from phalanx.model import memory

    return (
        f"longest sequence that fits {memory.format_bytes(budget)} per rank (zero3's model state, batch "
        f"{args.input.split('x')[0]}): {at_cp or 'none'} tokens at cp {args.cp}, {alone or 'none'} at cp 1"
    )


def _longest(model: Any, args: argparse.Namespace, sizes: list, optimizer: str, budget: int, cp: int) -> int:
    from phalanx.model.units import default_units
    from phalanx.plan import activations
    from phalanx.strategies import memory_plan
    from phalanx.strategies.plan import presets

    shape, dtype = activations.parse_input(args.input)
    # zero3, the most sharded, over the data-parallel and cp ranks (which shard model state alike)
    shards = presets.build(
        presets.AUTO_CHOOSES[-1],
        presets.asking(tp=args.tp, pp=args.pp),
        world_size=args.world_size,
        local_world_size=args.nproc_per_node or args.world_size,
    )
    state = max(b.total for b in memory_plan.rank_bytes(sizes, shards, optimizer))
    units = default_units(model)

    def fits(seq: int) -> bool:
        part = (shape[0], seq // cp, *shape[2:])
        acts = activations.measure(model, [activations.meta_input(part, dtype)], units)
        peak = acts.peak_checkpointed if args.activation_checkpointing else acts.peak
        return state + peak <= budget

    step = 2 * cp
    if not fits(step):
        return 0
    low, high = step, 2 * step
    while fits(high) and high < 2**24:  # double until it does not fit, then halve the gap
        low, high = high, 2 * high
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
