"""`split_batches`: a prepared loader's `batch_size` is the global batch, split over the data-parallel
ranks (Accelerate's setting of the same name and meaning).

Each data-parallel rank gets `batch_size / dp_size` samples a step, so the global batch, and with it
the optimisation, does not depend on how many ranks run: the same script resumes a checkpoint on
another world size (a job that lost a node) unchanged. A global batch that does not divide is
refused at prepare, with the nearest batch sizes and the world sizes that do: accumulation making up
the difference was the other option, and it was not taken (docs/elastic.md says why).
"""

from __future__ import annotations


def per_rank_batch_size(batch_size: int | None, dp_size: int, *, shard: bool = True) -> int:
    """`batch_size / dp_size`, or a ValueError that says which sizes would divide."""
    if not shard:
        raise ValueError(
            "split_batches: prepare(loader, shard=False) uses each rank's own data as it is, so there is no "
            "global batch to split. HINT: let phalanx shard the loader (shard=True), or give this rank's "
            "loader its per-rank batch size and turn split_batches off"
        )
    if batch_size is None:
        raise ValueError(
            "split_batches: this DataLoader has no batch_size (a custom batch_sampler, or batch_size=None), "
            "so there is no global batch to split. HINT: build it with batch_size=GLOBAL_BATCH (and "
            "shuffle or sampler), or turn split_batches off: a batch sampler's batches are dealt whole to ranks"
        )
    if batch_size % dp_size:
        raise ValueError(not_dividing_message(batch_size, dp_size))
    return batch_size // dp_size


def not_dividing_message(batch_size: int, dp_size: int) -> str:
    """`split_batches: the global batch 10 does not divide over 3 ...; HINT: batch_size 9 or 12 ...`."""
    lower, upper = batch_size // dp_size * dp_size, -(-batch_size // dp_size) * dp_size
    sizes = [s for s in (lower, upper) if s > 0]
    choices = " or ".join(f"{s} ({s // dp_size} per rank)" for s in sizes)
    worlds = ", ".join(str(n) for n in divisors(batch_size))
    return (
        f"split_batches: the DataLoader's batch_size {batch_size} is the global batch and does not divide "
        f"over {dp_size} data-parallel ranks. HINT: use batch_size {choices}, or run on a number of ranks "
        f"that divides {batch_size} ({worlds})"
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
