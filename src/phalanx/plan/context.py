"""`phalanx plan --cp N`: the figures of one context-parallel rank, which holds 1/N of every row.

Parameters, gradients and optimizer state are sharded (or replicated) over the data-parallel and cp
ranks together, so the strategies' columns are unchanged; the activations are measured on one
rank's part of the batch (`--input BxS` becomes `Bx(S/N)`)."""
from __future__ import annotations

import argparse


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree: each row's sequence cut over cp ranks; with --input BxS the "
                             "activations are one rank's part, B x S/cp (default 1)")


def cut_input(args: argparse.Namespace) -> str:
    """Check --cp against the layout and turn --input into one cp rank's part; the line to print
    under the table ('' without cp). ValueError with the fix."""
    cp = args.cp
    if cp == 1:
        return ""
    if cp < 1 or args.world_size % (cp * args.tp * args.pp):
        raise ValueError(f"--cp {cp} x --tp {args.tp} x --pp {args.pp} does not divide --world-size "
                         f"{args.world_size}. HINT: choose cp among "
                         f"{', '.join(str(d) for d in range(1, args.world_size + 1) if args.world_size % (d * args.tp * args.pp) == 0)}")
    if args.pp > 1:
        raise ValueError(f"--cp {cp} with --pp {args.pp}: context parallel is not composed with pipeline stages. "
                         "HINT: use --pp 1")
    if args.input is None:
        return f"context parallel: cp {cp}, each rank holds 1/{cp} of every row (give --input BxS for its activations)"
    shape_text, sep, dtype = args.input.partition(":")
    dims = shape_text.lower().split("x")
    if len(dims) < 2 or not dims[1].isdigit() or int(dims[1]) % (2 * cp):
        raise ValueError(f"--input {args.input!r} with --cp {cp}: the sequence (the second dim) must cut into 2 x cp = "
                         f"{2 * cp} equal chunks. HINT: a sequence length that is a multiple of {2 * cp}")
    seq = int(dims[1])
    dims[1] = str(seq // cp)
    args.input = "x".join(dims) + sep + dtype
    return (f"context parallel: cp {cp}, each rank holds {seq // cp} of every row's {seq} tokens: the activations "
            f"above are one rank's ({args.input}); data-parallel ranks {args.world_size // (cp * args.tp * args.pp)}")
