"""The step's wiring behind `px.backward`, `px.forward_backward`, `px.forward`,
`px.clip_grad_norm_` and `px.accumulate`: gradient accumulation, num_items' counts, and what runs
once per optimizer step before clipping and stepping. Every layout question goes to the strategy
(its pipeline runner, its cp context, its precision); the facade (facade.py) builds one `Stepping`
and delegates its verbs here."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import torch
from torch import nn

from phalanx.data.batch_records import BatchRecords
from phalanx.loop.accumulation import Accumulator
from phalanx.loop.num_items import ItemCount
from phalanx.runtime.step_tracker import Phase, StepTracker
from phalanx.strategies.base import Strategy


class Stepping:
    """One `Phalanx`'s step: its accumulation cycle, item counts and the optimizers it prepared."""

    def __init__(
        self,
        *,
        strategy: Callable[[], Strategy],
        decided: Callable[[], Strategy | None],
        grad_size: int,
        device: torch.device,
        accumulation: tuple[int, str],
        records: BatchRecords,
        progress: StepTracker,
        next_step: Callable[[], int],
        notify: Callable[..., None],
    ):
        """`strategy`: the strategy (raises while auto has not decided); `decided`: it, or None then.
        `accumulation`: (grad_accum_steps, grad_accum_remainder); `next_step`: the optimizer step
        about to be taken; `notify`: the loop's callback list (loop/callbacks.py)."""
        self._strategy, self._decided = strategy, decided
        self._records, self._progress, self._notify = records, progress, notify
        self.items = ItemCount(grad_size, device, next_step, self._grad_group)
        self.accumulator = Accumulator(
            *accumulation, batches_left=lambda: records.current().left, on_cycle_start=self.items.discard
        )
        self.optimizers: list[torch.optim.Optimizer] = []  # the strategy's optimizers, as prepared
        self._next_step = next_step
        self._token_weighted = False  # the last forward's labels= loss is the mean over every rank's targets

    def weighed_by_tokens(self, weighed: bool) -> None:
        """Whether a prepared model's last training forward made its `labels=` loss this rank's share of the
        mean over every data-parallel rank's targets (strategies/token_mean.py): its backward takes it as it is."""
        self._token_weighted = weighed

    def _grad_group(self) -> Any:
        """The gradient group of the strategy's layout; None (every rank) until auto decides."""
        strategy = self._decided()
        return None if strategy is None else strategy.layout.group("grad")

    def pipeline(self, model: nn.Module) -> Any:
        """The pipeline runner of a prepared model (pp > 1); None in other layouts."""
        strategy = self._decided()
        return strategy.pipeline(model) if strategy is not None else None

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None) -> None:
        """px.backward: the loss weighed, counted and scaled for the cycle, then the strategy's backward."""
        strategy = self._strategy()
        context = strategy.context
        # the short last step: each rank weighs by its real items, padding by none (data/batch_records.py),
        # unless the loss is weighed by the ranks' target tokens already
        if not self._token_weighted:
            loss, num_items = self._records.current().weigh(loss, num_items)
        self._token_weighted = False
        num_items = context.items_share(num_items)  # cp: this rank's part of a cut batch
        with self._progress.during(Phase.BACKWARD):
            scaled = self.accumulator.scale_loss(loss)  # first: it may start a new cycle
            if num_items is None:
                self.items.add_plain()
            else:
                scaled = self.items.add(loss, num_items, scaled)
            self._notify("on_backward", loss, num_items)
            strategy.backward(scaled)
            context.end_batch()  # a batch cut by px.shard_sequence ends with its backward

    def before_step(self) -> None:
        """Once per optimizer step, before clipping and stepping: the num_items rescale (and under
        `phalanx parity`, the step's record)."""
        self._strategy().before_step()  # pp: gradients of weights tied across stages summed
        self.items.finish(self.optimized_params(), self.accumulator.cycle_len)
        self._notify("before_step", self._next_step(), self.optimized_params())

    def optimized_params(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def forward_backward(
        self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, num_items: Any
    ) -> torch.Tensor:
        """px.forward_backward: the pipeline's schedule under pp, else the cp context's (the batch whole without cp)."""
        pipeline = self.pipeline(model)
        if pipeline is not None:
            with self._progress.during(Phase.PIPELINE):
                scale = self._strategy().precision.loss_scale() / self.accumulator.loss_divisor()
                return pipeline.train_step(
                    inputs, targets, loss_fn, loss_scale=scale, items=self.items, num_items=num_items
                )
        # under cp each rank runs its part of every row; without it, the batch whole
        return self._strategy().context.forward_backward(
            model, inputs, targets, loss_fn, num_items, call, self.backward
        )

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """px.forward: the pipeline's stages under pp, else `model(inputs)`."""
        pipeline = self.pipeline(model)
        if pipeline is not None:
            with self._progress.during(Phase.PIPELINE):
                return pipeline.forward(inputs)
        return call(model, inputs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> torch.Tensor | None:
        """px.clip_grad_norm_: on the cycle's syncing micro-step only."""
        if isinstance(parameters, nn.Module):
            parameters = parameters.parameters()
        return self.accumulator.when_syncing(self._clip, list(parameters), max_norm, norm_type)

    def _clip(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        self.ready_to_clip()
        return self._strategy().clip_grad_norm_(parameters, max_norm, norm_type)

    def ready_to_clip(self) -> None:
        for opt in self.optimizers:  # fp16: clip the true gradients, not the scaled ones
            self._strategy().precision.unscale_(opt)
        self.before_step()  # num_items: clip the gradients of the global mean

    def before_clip(self) -> None:
        """torch's clip_grad_norm_ on a prepared model prepares the gradients as px.clip_grad_norm_ (on its syncing step)."""
        if self.accumulator.sync_gradients:
            self.ready_to_clip()

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """px.accumulate: one micro-step, gradients synced on the cycle's last."""
        return self.accumulator.accumulate(lambda: self._strategy().no_sync(model))


def call(model: nn.Module, inputs: Any) -> Any:
    """`model(inputs)`: a tuple unpacked, a dict passed as keywords."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)
