"""An experts module's forward over the expert-parallel ranks: each (token, choice) pair goes by
all-to-all to the rank holding its expert, runs through the model's own experts forward there (on
this rank's experts, renumbered from 0), comes back by the reverse all-to-all and is weighted by its
router weight where it came from, as one process weights it.

transformers 5's experts modules (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3) take
`forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`; the model's math is kept
by calling that forward with each received row as one top-1 choice of weight 1. No pair is dropped
unless a capacity factor asks for it (capacity.py): the split sizes differ by rank and step
(exchanged first, one small all-to-all, or an all-gather of every rank's counts under a capacity),
and gloo and NCCL take uneven splits (measured on gloo: uneven and empty splits, with autograd).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
import torch.distributed as dist

# torch's differentiable all-to-all (torch.distributed.nn.functional's is deprecated for it); its
# backward is the reverse exchange. A private module path: used here only.
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from phalanx.strategies.expert_parallel import capacity


class Dispatch:
    """The forward of one experts module holding `local` of the `ranks` x `local` experts."""

    def __init__(
        self,
        module: nn.Module,
        params: tuple[str, ...],
        group: Any,
        ranks: int,
        local: int,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        rank: int = 0,
        capacity_factor: float | None = None,
        drops: Callable[[int], None] | None = None,
    ):
        self.module = module
        self.forward = module.forward  # the module's own forward, over its local experts
        self.params = params  # its split weights: DTensors, handed to its forward as their local parts
        self.group = group  # the ep ranks' group (None: every rank)
        self.ranks = ranks
        self.local = local
        self.reduce = reduce  # what each use's gradient of a local part goes through
        self.rank = rank  # this rank's place in the ep group: it holds experts [rank * local, (rank + 1) * local)
        self.capacity_factor = capacity_factor  # None: every pair computed
        self.drops = drops  # told each forward's dropped pairs (with a capacity factor)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order, counts, received_counts = self._route(experts)  # the pairs sent, by expert (so by rank)
        sent = hidden_states[order // k]
        send_sizes, receive_sizes = counts.sum(1).tolist(), received_counts.sum(1).tolist()
        received = _exchange(sent, receive_sizes, send_sizes, self.group)
        ids = torch.arange(self.local, device=experts.device).repeat(self.ranks)
        ids = ids.repeat_interleave(received_counts.reshape(-1)).unsqueeze(-1)
        with _local_parts(self.module, self.params, self.reduce):
            if received.shape[0] == 0:
                # nothing for this rank's experts: one zero row keeps them (and the exchange) in backward,
                # so every rank takes part in the same collectives; its zero gradient changes nothing
                out = self.forward(
                    received.sum(0, keepdim=True), ids.new_zeros(1, 1), received.new_ones(1, 1), *args, **kwargs
                )[:0]
            else:
                out = self.forward(received, ids, torch.ones_like(ids, dtype=received.dtype), *args, **kwargs)
        back = _exchange(out, send_sizes, receive_sizes, self.group)
        # each pair in its token's place again (a dropped one: zero)
        per_pair = back.new_zeros(tokens * k, back.shape[-1]).index_copy(0, order, back).view(tokens, k, -1)
        weighted = per_pair * top_k_weights.unsqueeze(-1).to(per_pair.dtype)
        return weighted.sum(1).to(hidden_states.dtype)

    def _route(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs to send (indices into `experts`, by expert), how many go to each of every rank's
        experts [ranks, local], and how many each rank sends to this rank's [ranks, local]."""
        if self.capacity_factor is None:
            counts = torch.bincount(experts, minlength=self.ranks * self.local).view(self.ranks, self.local)
            received_counts = torch.empty_like(counts)
            dist.all_to_all_single(received_counts, counts, group=self.group)  # how many rows each expert gets
            return torch.argsort(experts, stable=True), counts, received_counts
        kept, kept_counts, dropped = capacity.keep(
            experts, self.rank, self.ranks, self.ranks * self.local, self.capacity_factor, self.group
        )
        if self.drops is not None:
            self.drops(dropped)
        mine = kept_counts[:, self.rank * self.local : (self.rank + 1) * self.local]
        return kept, kept_counts[self.rank].view(self.ranks, self.local), mine.contiguous()


@contextlib.contextmanager
def _local_parts(
    module: nn.Module, names: tuple[str, ...], reduce: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """`module`'s DTensor weights `names` replaced by their local parts (differentiable: the gradient
    reaches the DTensor, through `reduce`) while its own forward runs, which indexes experts by local
    number. The hook sits on the part, not the parameter: a module moved with `.to()` may get new
    Parameter objects, and the part is made anew at each forward."""
    kept = {name: module._parameters[name] for name in names}
    try:
        for name, param in kept.items():
            part = param.to_local()
            if part.requires_grad:
                part.register_hook(reduce)
            module._parameters[name] = part  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(kept)


def _exchange(rows: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    """`rows` split by `send` to each rank, `receive` from each; differentiable (backward: the reverse)."""
    return wait_tensor(
        all_to_all_single_autograd(rows.contiguous(), receive, send, group if group is not None else dist.group.WORLD)
    )
