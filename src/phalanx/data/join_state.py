"""Under torch's Join every replica leaves with the last joiner's optimizer and scheduler state and
gradients, as DDP leaves every replica with its weights.

A rank that ran out of data early shadows its peers' gradient all-reduces but steps no optimizer,
and at the end DDP copies the weights of a rank that ran to the end onto every rank. The optimizer
and the LR scheduler are no part of DDP: the early rank kept Adam's moments and step count, and its
schedule, from fewer steps (measured: after an epoch of 3 batches on rank 0 and 2 on rank 1, rank 1
read lr 0.025 against 0.0125 and Adam step 2 against 3, and in the next, even epoch the replicas took
different steps, each averaged with the other's gradient, until DDP copied rank 0's weights over
again). The gradients too: with DDP's `gradient_as_bucket_view` (phalanx's default) the shadowed
all-reduces land in the early rank's `.grad`, which no `zero_grad` of its loop clears, so its first
backward of the next epoch added to them (grad norm 0.781 against one process's 0.638). This
joinable, last in Join's list, copies all of it from the same rank DDP copies the weights from (the
highest rank among the last joiners), so the next epoch starts as one model and one optimizer again.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Joinable, JoinHook


class LastJoinerState(Joinable):
    """Copy `optimizers`' and `schedulers`' state and `models`' gradients from the last joiner to
    every rank of `group` when Join ends (its post hook); no collective while the others still step."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Any],
        schedulers: Sequence[Any],
        group: Any,
        device: torch.device,
    ):
        super().__init__()
        self.models, self.optimizers, self.schedulers = list(models), list(optimizers), list(schedulers)
        self.group, self.device = group, device

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _CopyAtEnd(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.group


class _CopyAtEnd(JoinHook):
    def __init__(self, owner: LastJoinerState):
        self.owner = owner

    def post_hook(self, is_last_joiner: bool) -> None:
        owner = self.owner
        mine = dist.get_rank(owner.group)
        # the rank DDP's own post hook copies the weights from: the highest among the last joiners
        pick = torch.tensor([mine if is_last_joiner else -1], device=owner.device)
        dist.all_reduce(pick, op=dist.ReduceOp.MAX, group=owner.group)
        source = int(pick.item())
        params = [p for m in owner.models for p in m.parameters()]
        src = dist.get_global_rank(owner.group, source)
        states = [
            [o.state_dict() for o in owner.optimizers],
            [s.state_dict() for s in owner.schedulers],
            [p.grad is not None for p in params],
        ]
        dist.broadcast_object_list(states, src=src, group=owner.group)
        for param, held in zip(params, states[2]):
            if not held:
                param.grad = None
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.broadcast(param.grad, src=src, group=owner.group)
        if mine == source:
            return
        for optimizer, state in zip(owner.optimizers, states[0]):
            optimizer.load_state_dict(state)
        for scheduler, state in zip(owner.schedulers, states[1]):
            scheduler.load_state_dict(state)
