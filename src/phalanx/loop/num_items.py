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
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist



class ItemCount:
    """Σ num_items and Σ loss of this rank since the last optimizer step, and the rescale at the step.

    `world_size`: the data-parallel ranks gradients are averaged over, `group()` their process group
    (None: every rank). `step`: the number of the optimizer step about to be taken (for messages).
    """

    def __init__(self, world_size: int, device: torch.device, step: Callable[[], int],
                 group: Callable[[], Any] = lambda: None):
        self.world_size = world_size
        self.device = device
        self.step = step
        self.group = group
        self.items: torch.Tensor | None = None  # [Σ n, Σ loss, negatives seen] on this rank (float64)
        self.num_backward = 0  # backward calls with num_items since the last step
        self.num_plain = 0  # backward calls without num_items since the last step
        self.step_loss: float | None = None  # Σ loss / Σ n of the last step, over all ranks
        self.divisor: float | None = None  # every loss is divided by it (the same on every rank)

    def add(self, loss: torch.Tensor, num_items: Any, scaled: torch.Tensor) -> torch.Tensor:
        """Record one backward's summed loss and its item count (an int or a one-element tensor);
        return `scaled` (the loss as accumulation scaled it) divided by the common divisor."""
        count = _as_count(num_items)
        if isinstance(count, torch.Tensor):
            count = count.detach().to(self.device, torch.float64).reshape(())
            negative = (count < 0).to(torch.float64)
        else:
            if count < 0:
                raise ValueError(f"px.backward: num_items={num_items} is negative in step {self.step()}; it counts the "
                                 "items (target tokens, samples) the loss is summed over. HINT: pass 0 for a batch "
                                 "with nothing to count")
            count, negative = torch.tensor(float(count), dtype=torch.float64, device=self.device), None
        row = torch.stack([count, loss.detach().to(self.device, torch.float64).reshape(()),
                           negative if negative is not None else torch.zeros((), dtype=torch.float64,
                                                                             device=self.device)])
        self.items = row if self.items is None else self.items + row
        self.num_backward += 1
        if self.divisor is None:  # the run's first backward: its mean count over the ranks
            first = count.clone()
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(first, group=self.group())
            self.divisor = max(first.item() / self.world_size, 1.0)
        return scaled / self.divisor

    def add_plain(self) -> None:
        self.num_plain += 1

    def discard(self) -> None:
        """Forget a cycle that ended without a step (a dropped remainder)."""
        self.items, self.num_backward, self.num_plain = None, 0, 0

    def finish(self, params: Iterable[torch.Tensor], cycle_len: int) -> None:
        """Once per optimizer step, before clipping: all-reduce Σ n and rescale the gradients."""
        if self.num_backward == 0:
            self.num_plain = 0
            return
        step = self.step()
        if self.num_plain:
            raise ValueError(
                f"step {step}: px.backward was called {self.num_backward} time(s) with num_items and "
                f"{self.num_plain} time(s) without, in the same optimizer step. HINT: pass num_items on every "
                "backward of a step (0 for a batch with nothing to count), or on none")
        totals, calls = self.items, self.num_backward
        self.discard()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals, group=self.group())
        num_items, loss_sum, negatives = totals.tolist()  # one read-back per optimizer step
        if negatives > 0:
            raise ValueError(f"step {step}: num_items was negative in {int(negatives)} backward call(s) across the "
                             "ranks; it counts the items the loss is summed over. HINT: pass (labels != -100).sum()")
        if num_items <= 0:
            raise ValueError(
                f"step {step}: num_items summed to {num_items:g} over all {self.world_size} rank(s) and micro-steps: "
                "there is nothing to average the loss over. HINT: skip batches without target items before "
                "px.backward, or check the labels' padding value (-100 is ignored)")
        self.step_loss = loss_sum / num_items
        scale = self.world_size * cycle_len * self.divisor / num_items
        self.divisor = max(num_items / (self.world_size * calls), 1.0)  # the next step's: items per backward
        if scale != 1.0:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)


def _as_count(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"px.backward: num_items must be a number or a one-element tensor, got a tensor of "
                             f"shape {tuple(value.shape)}. HINT: pass (labels != -100).sum()")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"px.backward: num_items must be a number or a one-element tensor, got "
                         f"{type(value).__name__} {value!r:.40}")
    return value
