"""What a training step does under cp, for the facade: cut the batch, route the model's attention,
check that it went across the cut, and make the returned loss the whole row's."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.logging.rank_log import get_logger
from phalanx.strategies.context import cut_attention as attention_module
from phalanx.strategies.context import hf, labels, routing
from phalanx.strategies.context.layout import SequenceLayout, set_active, using_layout
from phalanx.strategies.context.shard import shard_sequence


@dataclass
class ContextParallel:
    """This rank's place in its cp group (size 1: no cut, every call passes through)."""

    size: int = 1
    rank: int = 0
    group: Any = None
    reported: bool = False
    cut: bool = False  # a batch was cut since the last backward: its loss is this rank's part of the rows
    shifts_labels: bool = False  # a transformers causal LM was prepared: its `labels=` are shifted before the cut

    def shard(
        self, inputs: Any, targets: Any = None, *, pad: bool = False, seq_dim: int = 1, activate: bool = True
    ) -> tuple[Any, Any, SequenceLayout]:
        """This rank's part of a batch (`px.shard_sequence`): inputs (a tensor [batch, seq] or a dict:
        input_ids, position_ids, attention_mask) and targets (shifted already) cut along the sequence
        with the load-balanced cut; positions stay global, the masks go to attention. pad=True pads
        the sequence to a multiple of 2 x cp (masked, targets -100). The cut stays active until
        px.backward: transformers models and px.attention read it (F.scaled_dot_product_attention is
        routed inside px.forward_backward only). A transformers causal LM's `labels` in the inputs
        are shifted over the whole row first (labels.py)."""
        self.cut = self.size > 1
        if self.shifts_labels and self.size > 1:
            inputs = labels.shift_before_cut(inputs, self.size)
        return shard_sequence(
            inputs,
            targets,
            cp_size=self.size,
            cp_rank=self.rank,
            group=self.group,
            pad=pad,
            seq_dim=seq_dim,
            activate=activate,
        )

    def items_share(self, num_items: Any) -> Any:
        """This rank's share of `num_items`, the batch's count (every verb takes the batch's): a cut
        batch's loss is this rank's part of the rows, and the cp ranks' shares add up to the count
        (ItemCount sums the counts over the ranks gradients are averaged over, cp ones included)."""
        if num_items is None or not self.cut:
            return num_items
        return num_items / self.size

    def end_batch(self) -> None:
        """The batch cut by shard_sequence is done (its backward ran): later forwards see whole rows."""
        self.cut = False
        set_active(None)

    def prepare(self, model: nn.Module) -> None:
        """Route `model`'s attention across the cut; ValueError naming what cannot be routed."""
        if self.size == 1:
            return
        for name, module in model.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                raise ValueError(
                    f"context parallel: {name or 'the model'} is an nn.MultiheadAttention, which computes attention "
                    "inside torch where phalanx cannot send it across the cut. HINT: compute attention with "
                    "px.attention(q, k, v) or F.scaled_dot_product_attention(q, k, v, is_causal=True), or run cp=1"
                )
        if hf.is_transformers_model(model):
            hf.route(model)
            self.shifts_labels = self.shifts_labels or labels.shifts_labels(model)

    @contextlib.contextmanager
    def forward(self, model: nn.Module, layout: SequenceLayout) -> Iterator[None]:
        """The model's forward over a cut batch: attention reads `layout`; SDPA calls are routed;
        a forward in which no attention crossed the cut is refused (each rank would see only its part)."""
        before = attention_module.last_used.get("calls", 0)
        try:
            with using_layout(layout), routing.routed():
                yield
        except RuntimeError as error:  # a model with no sequence to cut (an MLP's features) fails on the cut
            if attention_module.last_used.get("calls", 0) == before:
                self.end_batch()
                raise ValueError(
                    _no_attention(
                        model,
                        " before its forward failed on the cut batch (px.forward_backward "
                        "cuts dim 1 of the inputs as the sequence)",
                    )
                ) from error
            raise
        if attention_module.last_used.get("calls", 0) == before:
            raise ValueError(_no_attention(model, ""))
        if not self.reported:
            self.reported = True
            get_logger().info(
                "context parallel: cp=%d, attention by %s (%s)",
                self.size,
                attention_module.last_used["algorithm"],
                attention_module.last_used["why"],
            )

    def whole_loss(self, loss: torch.Tensor, summed: bool) -> torch.Tensor:
        """The loss of the whole rows from each rank's part: the sum (summed losses) or the mean."""
        loss = loss.detach().clone()
        if self.size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.group)
            if not summed:
                loss /= self.size
        return loss

    def forward_backward(
        self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, num_items: Any, call: Any, backward: Any
    ) -> torch.Tensor:
        """px.forward_backward over a cut batch: this rank's part through the model and the loss,
        backward (num_items, the batch's count, shared by px.backward: `items_share`), and the
        whole rows' loss returned. Without cp: the batch whole, through the model, the loss and backward."""
        if self.size == 1:
            loss = loss_fn(call(model, inputs), targets)
            backward(loss, num_items=num_items)
            return loss.detach()
        local_inputs, local_targets, layout = self.shard(inputs, targets, activate=False)  # active in the forward only
        with self.forward(model, layout):
            output = call(model, local_inputs)
        loss = loss_fn(output, local_targets)
        backward(loss, num_items=num_items)
        return self.whole_loss(loss, summed=num_items is not None)


def _no_attention(model: nn.Module, when: str) -> str:
    return (
        f"context parallel: no attention of {_model_name(model)} went across the cut{when}, so each rank "
        "attended only to its own part of the sequence. HINT: compute attention with px.attention(q, k, v) or "
        "F.scaled_dot_product_attention(q, k, v, is_causal=True) (no attn_mask), use a transformers model, or run "
        "cp=1"
    )


def _model_name(model: nn.Module) -> str:
    """The user's class of a prepared model: DDP's `module`, FSDP2's generated FSDP<Name> class skipped."""
    inner = getattr(model, "module", model)
    return next(c.__name__ for c in type(inner).__mro__ if not c.__name__.startswith("FSDP"))
