"""The user's param_group dicts, shared with the optimizer phalanx steps in place of the user's (zero1's
sharded-state optimizer, the whole-tensor step).

An LR scheduler built on the user's optimizer before `px.prepare` (transformers'
`get_linear_schedule_with_warmup(opt, ...)`, torch's `LambdaLR(opt, ...)`), and not passed to prepare,
writes its learning rates into that optimizer's param_group dicts. The optimizer that steps reads the
same dicts, never copies: else it would keep the learning rate the scheduler set at its construction
(0.0 at the start of a warmup) while `get_last_lr()` shows the schedule. torch's
`Optimizer.load_state_dict` builds new dicts; `keeping_groups` loads into the shared ones instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def shared_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """`optimizer`'s param_group dicts themselves, for the optimizer that steps in its place."""
    return list(optimizer.param_groups)


@contextlib.contextmanager
def keeping_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around torch's `load_state_dict`: the loaded hyperparameters go into the dicts `optimizer` held
    before, which stay its groups (and the user's optimizer's, and its scheduler's)."""
    kept = list(optimizer.param_groups)
    yield
    for old, new in zip(kept, optimizer.param_groups):
        if old is not new:
            old.clear()
            old.update(new)
    optimizer.param_groups = kept
