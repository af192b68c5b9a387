"""`px.backward(loss, num_items=n)`: a loss summed over `n` items (target tokens, samples), averaged
over the whole global batch.

Averaging each micro-batch's mean weights a micro-batch of 3 tokens like one of 3,000. The right
figure is Σ loss / Σ n over every rank and micro-step of an optimizer step, but Σ n is known only
when the cycle ends. So nothing is divided while it runs: each backward takes the sum as it is
(divided by the cycle length, like any accumulated loss), and once per optimizer step, before
clipping and stepping, one small all-reduce gathers Σ n (and Σ loss, for the logged mean) and the
gradients are multiplied once by world_size · cycle_len / Σ n. The strategies average gradients
over the ranks (DDP's all-reduce, FSDP2's reduce-scatter) and phalanx divides by the cycle length:
the factor turns that average into Σ ∇loss / Σ n, under every strategy, accumulation and padding.

A summed loss is n times larger than a mean, which fp16's loss scale would overflow: each loss is
divided by a constant common to all ranks, the previous step's mean items per backward (for the
first step: the first backward's, from one all-reduce that happens once per run), and the factor
multiplies it back. Gradients then have a mean's magnitude all along.

Every check is made the same way on every rank, after a collective every rank takes part in, so
a bad value raises the same error everywhere instead of on one rank while the others wait: the
first backward of the run (with num_items or without) agrees over one all-reduce whether the
script passes num_items (on every rank, or on none); from then on each optimizer step's
all-reduce carries, besides Σ n and Σ loss, the count of negative or malformed values and of
backward calls without num_items.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist


_N, _LOSS, _NEGATIVE, _MALFORMED, _PLAIN = range(5)  # the columns of a rank's row


class ItemCount:
    """Σ num_items and Σ loss of this rank since the last optimizer step, and the rescale at the step.

    `world_size`: the data-parallel ranks gradients are averaged over, `group()` their process group
    (None: every rank). `step`: the number of the optimizer step about to be taken (for messages).
    """

    def __init__(
        self, world_size: int, device: torch.device, step: Callable[[], int], group: Callable[[], Any] = lambda: None
    ):
        self.world_size = world_size
        self.device = device
        self.step = step
        self.group = group
        self.items: torch.Tensor | None = None  # this rank's row (float64): see the columns above
        self.num_backward = 0  # backward calls with num_items since the last step
        self.used: bool | None = None  # whether the script passes num_items (agreed at the first backward)
        self.step_loss: float | None = None  # Σ loss / Σ n of the last step, over all ranks
        self.divisor: float | None = None  # every loss is divided by it (the same on every rank)

    # ---- each backward -------------------------------------------------------------------
    def add(self, loss: torch.Tensor, num_items: Any, scaled: torch.Tensor) -> torch.Tensor:
        """Record one backward's summed loss and its item count (an int or a one-element tensor);
        return `scaled` (the loss as accumulation scaled it) divided by the common divisor."""
        divisor = self.begin(num_items)
        self.add_loss(loss)
        return scaled / divisor

    def begin(self, num_items: Any) -> float:
        """Record a backward's item count before its loss is known (a pipeline step computes the loss
        while it runs the backward); return the divisor its summed loss is divided by."""
        count, negative, malformed = self._count(num_items)
        row = torch.zeros(5, dtype=torch.float64, device=self.device)
        row[_N], row[_NEGATIVE], row[_MALFORMED] = count, negative, malformed
        self._add_row(row)
        self.num_backward += 1
        if self.used is None:
            self._agree(True, count)
        elif not self.used:
            raise ValueError(
                f"px.backward: num_items given in step {self.step()}, but the run's first backward (on every "
                "rank) had none, so the ranks do not all-reduce item counts. HINT: pass num_items on every "
                "backward from the first one (0 for a batch with nothing to count), or on none"
            )
        assert self.divisor is not None  # noqa: S101 - set by the agreement
        return self.divisor

    def add_loss(self, loss: torch.Tensor) -> None:
        """The summed loss of the backward `begin` counted."""
        assert self.items is not None  # noqa: S101 - begin() came first
        self.items[_LOSS] += loss.detach().to(self.device, torch.float64).reshape(())

    def add_plain(self) -> None:
        """A backward without num_items: counted, so a step that mixes both is refused on every rank."""
        if self.used is None:
            self._agree(False, torch.zeros((), dtype=torch.float64, device=self.device))
        if self.used:
            row = torch.zeros(5, dtype=torch.float64, device=self.device)
            row[_PLAIN] = 1
            self._add_row(row)

    def _add_row(self, row: torch.Tensor) -> None:
        self.items = row if self.items is None else self.items + row

    def _count(self, num_items: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(count, 1.0 if negative, 1.0 if malformed): a bad value is counted, raised after the
        step's all-reduce on every rank alike."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        if _malformed(num_items):
            return zero, zero, 1.0
        if isinstance(num_items, torch.Tensor):
            count = num_items.detach().to(self.device, torch.float64).reshape(())
        else:
            count = torch.tensor(float(num_items), dtype=torch.float64, device=self.device)
        return count, (count < 0).to(torch.float64), 0.0

    def _agree(self, used: bool, count: torch.Tensor) -> None:
        """The run's first backward: do all data-parallel ranks pass num_items, and the first divisor."""
        row = torch.stack(
            [count.reshape(()).clamp(min=0), torch.tensor(float(used), dtype=torch.float64, device=self.device)]
        )
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(row, group=self.group())
        total, users = row.tolist()
        if 0 < users < self.world_size:
            raise ValueError(
                f"px.backward: num_items was given on {int(users)} of {self.world_size} data-parallel ranks in the "
                "run's first backward and was None on the others. HINT: pass num_items on every rank (0 for a batch "
                "with nothing to count), or on none"
            )
        self.used = users > 0
        self.divisor = max(total / self.world_size, 1.0)

    def discard(self) -> None:
        """Forget a cycle that ended without a step (a dropped remainder)."""
        self.items, self.num_backward = None, 0

    # ---- each optimizer step ---------------------------------------------------------------
    def finish(self, params: Iterable[torch.Tensor], cycle_len: int) -> None:
        """Once per optimizer step, before clipping: all-reduce Σ n and rescale the gradients."""
        if not self.used or self.items is None:  # nothing counted since the last step (e.g. clip, then step)
            self.discard()
            return
        step = self.step()
        totals = self.items
        calls = self.num_backward
        self.discard()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, group=self.group())
        num_items, loss_sum, negatives, bad, plain = totals.tolist()  # one read-back per optimizer step
        if bad > 0:
            raise ValueError(
                f"step {step}: num_items was not a number or a one-element tensor in {int(bad)} backward "
                "call(s) across the ranks. HINT: pass (labels != -100).sum(), a number or a one-element "
                "tensor"
            )
        if plain > 0:
            raise ValueError(
                f"step {step}: px.backward was called {int(plain)} time(s) without num_items across the ranks, in a "
                "run that passes it. HINT: pass num_items on every backward of every rank (0 for a batch with "
                "nothing to count), or on none"
            )
        if negatives > 0:
            raise ValueError(
                f"step {step}: num_items was negative in {int(negatives)} backward call(s) across the "
                "ranks; it counts the items the loss is summed over. HINT: pass (labels != -100).sum()"
            )
        if num_items <= 0:
            raise ValueError(
                f"step {step}: num_items summed to {num_items:g} over all {self.world_size} rank(s) and micro-steps: "
                "there is nothing to average the loss over. HINT: skip batches without target items before "
                "px.backward, or check the labels' padding value (-100 is ignored)"
            )
        self.step_loss = loss_sum / num_items
        scale = self.world_size * cycle_len * self.divisor / num_items
        self.divisor = max(num_items / (self.world_size * max(calls, 1)), 1.0)  # the next step's: items per backward
        if scale != 1.0:
            grads = [p.grad for p in params if p.grad is not None]
            for kind in {type(g) for g in grads}:  # one foreach per tensor type: tp mixes DTensors and tensors
                torch._foreach_mul_([g for g in grads if type(g) is kind], scale)


def _malformed(value: Any) -> bool:
    """A num_items value that is neither a number nor a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() != 1
    return isinstance(value, bool) or not isinstance(value, numbers.Real)
