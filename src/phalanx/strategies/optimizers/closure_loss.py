"""One loss for every replica: the closure an optimizer calls, with its loss averaged over the
data-parallel ranks.

An optimizer that reads the closure's loss (LBFGS's strong-Wolfe line search and its
`tolerance_change` test, a user's optimizer phalanx cannot classify) would otherwise read each
replica's own loss on its own shard of the batch: the replicas take different steps, then call the
closure a different number of times and hang in the gradients' all-reduce. With the loss averaged
(the gradients already are), every replica reads the global batch's loss and gradients, as one
process would, and so takes the same step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from phalanx.strategies.optimizers import optimizer_kinds
from phalanx.strategies.optimizers.optimizer_kinds import Route
from phalanx.strategies.plan.parallel_plan import ParallelPlan

Closure = Callable[[], Any]


def mean_over(loss: Any, group: Any, size: int) -> Any:
    """`loss` (a tensor or a number) averaged over `group`'s `size` ranks, detached, same kind back."""
    if loss is None:
        return None
    value = loss.detach().clone() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
    dist.all_reduce(value, group=group)  # SUM: gloo has no AVG
    value /= size
    return value if isinstance(loss, torch.Tensor) else float(value)


def agreeing(closure: Closure, group: Any, size: int) -> Closure:
    """`closure`, returning its loss averaged over the data-parallel ranks."""

    @functools.wraps(closure)
    def reduced() -> Any:
        return mean_over(closure(), group, size)

    return reduced


def closure_wrapper(
    optimizer: torch.optim.Optimizer, plan: ParallelPlan, group: Any
) -> Callable[[Closure], Closure] | None:
    """What wraps the closure passed to `optimizer.step`, or None where replicas cannot part on
    its loss: one replica, or an optimizer phalanx knows to read gradients only."""
    if plan.dp_size == 1:
        return None
    kind = optimizer_kinds.classify(optimizer)
    if not optimizer_kinds.reads_its_loss(kind):
        return None
    if optimizer_kinds.route(kind.kind, plan, type(optimizer).__name__, kind.declared) is not Route.AS_GIVEN:
        return None  # stepped on an owner: whole_tensor_step calls the closure once, for its gradients
    return functools.partial(agreeing, group=group, size=plan.dp_size)
