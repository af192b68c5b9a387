"""Running a rank's pipeline stages with torch's schedules: one training step, or a forward.

Every rank of a pipeline calls `step(inputs, targets)` with the same batch (data follows the
data-parallel dimensions only); the first stage feeds `inputs` to the model, the last stage gives
its output and `targets` to the loss, and every rank gets back the loss, the mean over the
microbatches, broadcast from the last stage. Gradients are left in `.grad` (already reduced over
the data-parallel group when the stages are DDP- or FSDP-wrapped), to be stepped as usual.

torch's stages learn the shapes of what they send from a first microbatch (a forward, a loss and a
backward of it that touch no gradients), so one schedule is kept per input shape and mode; a new
shape (a short last batch) builds another. Under a loop's usual fixed shapes that happens once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies.pipeline import schedules as names

LossFn = Callable[[Any, Any], torch.Tensor]
_KEPT_SCHEDULES = 4  # shapes kept built at once (each holds its receive buffers)


def _group(group_or_mesh: Any) -> dist.ProcessGroup:
    if hasattr(group_or_mesh, "get_group"):  # a 1-D DeviceMesh, e.g. mesh["pp"]
        return group_or_mesh.get_group()
    return group_or_mesh


def _same(output: Any) -> Any:
    return output


def _one_tensor(inputs: Any) -> None:
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(
            f"the pipeline's first stage takes one tensor, and the inputs are a {type(inputs).__name__}. "
            "HINT: pass the one tensor the model's forward takes; fold other inputs into it, or give "
            "them defaults in forward"
        )


class PipelineRunner:
    """Runs this rank's stage module(s) of a pipeline of `num_stages` stages over `group`.

    `stages` / `stage_index`: the module of each stage this rank runs (DDP- or FSDP-wrapped or plain)
    and its index, one of each for 1F1B/GPipe, as `schedules.stage_indices` places them otherwise.
    `group`: the pipeline's process group, or its 1-D mesh (`mesh["pp"]`). `loss_fn(output, targets)`,
    given the output as `model_output` makes it (what one process's model returns), must average over
    the samples it is given (the step's loss is the mean of the microbatches').
    """

    def __init__(
        self,
        stages: nn.Module | Sequence[nn.Module],
        stage_index: int | Sequence[int],
        num_stages: int,
        group: Any,
        device: torch.device | str,
        schedule: str = names.DEFAULT_SCHEDULE,
        num_microbatches: int | None = None,
        loss_fn: LossFn | None = None,
    ):
        self.modules = (stages,) if isinstance(stages, nn.Module) else tuple(stages)
        self.stage_indices = (stage_index,) if isinstance(stage_index, int) else tuple(stage_index)
        self.group = _group(group)
        self.pp = dist.get_world_size(self.group)
        self.pp_rank = dist.get_rank(self.group)
        self.schedule = names.schedule_name(schedule)
        self.num_stages = num_stages
        self.device = torch.device(device)
        per_rank = names.stages_per_rank(self.schedule, len(self.modules) if self.schedule in names.LOOPED else None)
        expected = names.stage_indices(self.schedule, self.pp_rank, self.pp, per_rank)
        if (
            len(self.modules) != len(self.stage_indices)
            or tuple(sorted(self.stage_indices)) != tuple(sorted(expected))
            or num_stages != self.pp * per_rank
        ):
            raise ValueError(
                f"pp_schedule={self.schedule} on pipeline rank {self.pp_rank} of {self.pp} runs stages "
                f"{list(expected)} of {self.pp * per_rank}, but was given {len(self.modules)} module(s) for "
                f"stages {list(self.stage_indices)} of {num_stages}"
            )
        self.num_microbatches = num_microbatches or names.default_microbatches(self.pp)
        names.check_microbatches(self.schedule, self.pp, self.num_microbatches)
        self.loss_fn = loss_fn
        self.is_first = 0 in self.stage_indices
        self.is_last = num_stages - 1 in self.stage_indices
        self._last = dist.get_global_rank(self.group, names.last_stage_rank(self.schedule, self.pp))
        self._built: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._loss_scale: float | torch.Tensor = 1.0
        self._step_microbatches = self.num_microbatches  # this step's (a short batch may take fewer)
        self._summed = False  # this step's loss_fn sums over items: no mean over the microbatches
        self._running = False
        # what one process's model returns, from the last stage's output (transformers: its ModelOutput)
        self.model_output: Callable[[Any], Any] = _same
        self.tied: Any = None  # a pipeline/tied.py TiedGradients when parameters are tied across ranks
        self._tied_pending = False

    def sync_tied(self) -> None:
        """Sum the gradients of parameters tied across pipeline ranks, once after training steps."""
        if self.tied is not None and self._tied_pending:
            self.tied.sync()
        self._tied_pending = False

    def counted_elsewhere(self) -> list[torch.Tensor]:
        """This rank's tied copies whose gradient another pipeline rank counts in the norm."""
        return self.tied.counted_elsewhere() if self.tied is not None else []

    def refuse_direct_calls(self, model: nn.Module, hint: str | None = None) -> None:
        """Make a call of `model` outside this runner raise: a rank's model runs only its own stages'
        units, so `model(x)` would quietly compute something else than the whole model."""
        hint = (
            hint
            or "HINT: train with PipelineRunner.step(inputs, targets), evaluate with PipelineRunner.forward(inputs)"
        )

        def refuse(module: nn.Module, args: Any) -> None:
            if not self._running:
                raise RuntimeError(
                    f"this model is pipeline stage(s) {list(self.stage_indices)} of {self.num_stages} (pipeline rank "
                    f"{self.pp_rank} of {self.pp}): calling it runs only those stages' units, not the whole model. {hint}"
                )

        model.register_forward_pre_hook(refuse)

    def _run(self, schedule: Any, *args: Any, **kwargs: Any) -> Any:
        self._running = True
        try:
            return schedule.step(*args, **kwargs)
        finally:
            self._running = False

    # ---- building torch's stages and schedule, once per (mode, input shape) -------------------
    def _scaled_loss(self, output: Any, targets: Any) -> torch.Tensor:
        assert self.loss_fn is not None  # noqa: S101 - step() checks it
        per = 1 if self._summed else self._step_microbatches
        return self.loss_fn(self.model_output(output), targets) * (self._loss_scale / per)

    def _build(self, training: bool, microbatches: int) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [
            PipelineStage(m, i, self.num_stages, self.device, group=self.group)
            for m, i in sorted(zip(self.modules, self.stage_indices), key=lambda mi: mi[1])
        ]
        if training:
            cls, loss = get_schedule_class(self.schedule), self._scaled_loss
        else:  # forward only: GPipe's (or its looped form's) order, which any placement but a V runs
            cls, loss = get_schedule_class("GPipe" if self.schedule in names.SINGLE else "LoopedBFS"), None
        target = stages[0] if self.schedule in names.SINGLE else stages
        # scale_grads=False: the loss is divided by the microbatch count instead, so gradients
        # accumulated over several steps are not divided again.
        return cls(target, microbatches, loss_fn=loss, scale_grads=False)

    def _schedule_for(self, training: bool, inputs: torch.Tensor, microbatches: int) -> Any:
        key = (training, tuple(inputs.shape), inputs.dtype, microbatches)
        if key not in self._built:
            self._built[key] = self._build(training, microbatches)
            while len(self._built) > _KEPT_SCHEDULES:
                self._built.popitem(last=False)
        self._built.move_to_end(key)
        return self._built[key]

    # ---- running -------------------------------------------------------------------------------
    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_scale: float | torch.Tensor = 1.0,
        loss_fn: LossFn | None = None,
        summed: bool = False,
    ) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; the loss (mean over microbatches)
        on every pipeline rank. `loss_scale` multiplies the loss backward sees (accumulation's
        1/steps, fp16's scale), not the one returned. `loss_fn`: this step's (default: the runner's).
        `summed`: `loss_fn` sums over the items it is given (px.forward_backward's num_items): the
        microbatches' losses are added, not averaged, and the sum is returned."""
        if loss_fn is not None:
            self.loss_fn = loss_fn
        if self.loss_fn is None:
            raise ValueError("this PipelineRunner has no loss_fn: give one to train, or call forward() to evaluate")
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "a pipeline training step needs autograd: it was called under torch.no_grad(). "
                "HINT: evaluate with forward() instead."
            )
        _one_tensor(inputs)
        microbatches = names.microbatches_for(self.schedule, self.pp, self.num_microbatches, inputs.size(0))
        schedule = self._schedule_for(True, inputs, microbatches)
        self._loss_scale, self._step_microbatches, self._summed = loss_scale, microbatches, summed
        self._tied_pending = True
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        if self.is_last:
            self._run(schedule, *args, target=targets, losses=losses)
            loss = (torch.stack([x.detach().float() for x in losses]).sum() / loss_scale).reshape(())
        else:
            self._run(schedule, *args)
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._loss_scale = 1.0
        dist.broadcast(loss, src=self._last, group=self.group)
        return loss

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_fn: LossFn,
        *,
        loss_scale: float | torch.Tensor,
        items: Any,
        num_items: Any = None,
    ) -> torch.Tensor:
        """`step` for px.forward_backward: without `num_items` the mean loss; with it every
        microbatch's summed loss over the common divisor of the step (`items`: loop/num_items.py's
        ItemCount), and the batch's sum returned."""
        if num_items is None:
            items.add_plain()
            return self.step(inputs, targets, loss_scale=loss_scale, loss_fn=loss_fn)
        divisor = items.begin(num_items)
        loss = self.step(inputs, targets, loss_scale=loss_scale / divisor, loss_fn=loss_fn, summed=True)
        items.add_loss(loss)
        return loss

    def forward(self, inputs: torch.Tensor) -> Any:
        """The last stage's output for `inputs` (no gradients), on every pipeline rank, as `model_output`
        gives it (a transformers model's ModelOutput with its logits). Any batch size:
        it is cut into as many equal microbatches as divide it, up to num_microbatches."""
        if self.schedule in names.V_SHAPED:
            raise ValueError(
                f"pp_schedule={self.schedule} cannot run forward-only in torch {torch.__version__.split('+')[0]} "
                "(its V placement has no forward-only schedule; torch's eval() fails with \"can't "
                'steal_bwd_input"). HINT: evaluate under 1F1B, GPipe or an interleaved schedule, or compute '
                "the evaluation loss with training steps' loss under torch's pipeline."
            )
        _one_tensor(inputs)
        microbatches = max(
            d for d in range(1, min(self.num_microbatches, inputs.size(0)) + 1) if inputs.size(0) % d == 0
        )
        schedule = self._schedule_for(False, inputs, microbatches)
        with torch.no_grad():
            output = self._run(schedule, *((inputs,) if self.is_first else ()))
        return self.model_output(self._broadcast_output(output if self.is_last else None))

    def _broadcast_output(self, output: Any) -> torch.Tensor:
        meta: list[Any] = [None]
        if self.is_last:
            meta[0] = (
                (tuple(output.shape), output.dtype)
                if isinstance(output, torch.Tensor)
                else f"the last stage returned a {type(output).__name__}"
            )
        dist.broadcast_object_list(meta, src=self._last, group=self.group, device=self.device)
        if isinstance(meta[0], str):
            raise TypeError(f"{meta[0]}; PipelineRunner.forward returns one tensor to every pipeline rank")
        shape, dtype = meta[0]
        if not self.is_last:
            output = torch.empty(shape, dtype=dtype, device=self.device)
        output = output.detach().contiguous()
        if math.prod(shape):
            dist.broadcast(output, src=self._last, group=self.group)
        return output
