"""`save_pretrained` on a model whose parameters are split over ranks (zero2/zero3/hsdp, tensor
parallel, pipeline stages): transformers' convention, every rank calls it, writes one process's
full model.

transformers' own `save_pretrained` reads `state_dict()`, which there holds DTensors or one stage,
and safetensors fails on them ("Attempted to access the data pointer on an invalid python
storage"), leaving the directory without weights. Here the full weights are gathered first, every
rank taking part, and the main process writes them with transformers' own code, so
`from_pretrained` loads what one process would have saved. Called on one rank only (`if
is_main_process:`), the gather would wait forever for the others: the ranks first agree through the
job's store (runtime/arrival.py), and a rank that waits alone is refused, naming `px.get_state_dict`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from phalanx.runtime import collectives
from phalanx.runtime.arrival import every_rank_called

AGREE_SECONDS = 60.0  # how long a caller waits for the other ranks to call too


def save_full(
    save: Callable[..., Any],
    full_state_dict: Callable[[], dict[str, Any]],
    save_directory: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """`save(save_directory, *args, state_dict=full, **kwargs)` on the main process, the full weights
    gathered by every rank; ValueError where this rank calls alone."""
    if "state_dict" in kwargs or not collectives.is_distributed():  # the script gathered them itself
        return save(save_directory, *args, **kwargs)
    _agree_every_rank_called()
    full = full_state_dict()
    result = None
    if dist.get_rank() == 0:
        kwargs["is_main_process"] = True
        result = save(save_directory, *args, state_dict=full, **kwargs)
    collectives.barrier()  # the files are there when any rank returns (a from_pretrained may follow)
    return result


def _agree_every_rank_called() -> None:
    every_rank_called(
        "save_pretrained",
        AGREE_SECONDS,
        lambda rank, absent: (
            f"phalanx: save_pretrained on rank {rank}: this model's weights are split over the ranks, and "
            f"rank(s) {absent} did not call save_pretrained within {AGREE_SECONDS:g} s, so the full model "
            "cannot be gathered. HINT: call model.save_pretrained(d) on every rank (transformers' convention; "
            "the main process writes), or gather first on every rank, full = px.get_state_dict(model), and "
            "save on the main process: model.save_pretrained(d, state_dict=full)"
        ),
    )
