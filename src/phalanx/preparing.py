"""`px.prepare`'s wiring: a model through the strategy (and strategy auto's decision), an optimizer
inside the accumulation wrapper, a scheduler bound to it, a loader cut to this rank's shard; each
tracked by the checkpointer and watched by the step tracker, and the loop's callbacks told. The
facade (facade.py) builds one `Preparing` and delegates its prepare verbs here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import refusal
from phalanx.checkpoint.manager import Checkpointer
from phalanx.checkpoint.state import base_optimizer
from phalanx.checkpoint.tied_names import tied_names
from phalanx.config import PhalanxConfig
from phalanx.config.names import Needs
from phalanx.data.batch_records import BatchRecords
from phalanx.data import shadow_rows
from phalanx.data.loader import PreparedLoader, scale_batch
from phalanx.loop import scheduler as lr_scheduler
from phalanx.loop.accumulation import wrap_optimizer
from phalanx.loop.callbacks import LoopCallbacks
from phalanx.model import compile as compile_units
from phalanx.model import flops
from phalanx.runtime import device_peaks
from phalanx.runtime.context import DistContext
from phalanx.runtime.profiler import StepProfiler
from phalanx.runtime.step_tracker import StepTracker, watch_module, watch_optimizer
from phalanx.stepping import Stepping
from phalanx.strategies import ddp_options, token_mean, user_state
from phalanx.strategies.base import Strategy
from phalanx.strategies.choice import StrategyChoice
from phalanx.strategies.optimizers.closure_loss import closure_wrapper
from phalanx.strategies.plan.parallel_plan import ParallelPlan


@dataclass
class Preparing:
    """What preparing needs of the `Phalanx` it serves, and the objects it prepared."""

    strategy: Callable[[], Strategy]  # raises while strategy auto has not decided
    decide: Callable[[nn.Module], None]  # strategy auto: decide from this model (a no-op once decided)
    plan: Callable[[], ParallelPlan]  # the job's plan (auto's decided one after prepare(model))
    config: PhalanxConfig
    choice: StrategyChoice
    ctx: DistContext
    seed: int
    device_placement: Callable[[], bool]  # px.device_placement, which a script may change
    step: Stepping
    records: BatchRecords
    progress: StepTracker
    checkpointer: Checkpointer
    callbacks: LoopCallbacks
    throughput: Any  # the logging session's meter: the model's FLOPs, the batches counted
    profiler: StepProfiler | None
    prepared: list[Any] = field(default_factory=list)  # models, optimizers and schedulers, for join()/uneven_inputs()
    replaced: dict[int, torch.optim.Optimizer] = field(default_factory=dict)  # user's optimizer -> the strategy's

    def prepare(self, objects: tuple[Any, ...], shard: bool) -> Any:
        """px.prepare: models first (an optimizer binds to their wrapped parameters), then
        optimizers and loaders, then schedulers; other objects with state are checkpointed."""
        prepared: list[Any] = list(objects)
        models = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
        for i in models:
            with refusal.refusing():  # a layout this model cannot take: said once, not per rank (phalanx/refusal.py)
                prepared[i] = self.model(objects[i])
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                model = prepared[models[0]] if len(models) == 1 else None
                prepared[i] = self.optimizer(obj, model)
            elif isinstance(obj, DataLoader):
                prepared[i] = self.data_loader(obj, shard=shard)
        for i, obj in enumerate(objects):  # after the optimizers, which schedulers may need rebinding to
            if lr_scheduler.is_scheduler(obj):
                prepared[i] = self.scheduler(obj)
            elif not isinstance(obj, (nn.Module, torch.optim.Optimizer, DataLoader)) and hasattr(
                obj, "load_state_dict"
            ):  # a grad scaler, the user's own state
                self.checkpointer.register(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def model(self, model: nn.Module) -> nn.Module:
        """px.prepare_model."""
        model, compiled = compile_units.unwrap_compiled(model)  # torch.compile(model) before prepare
        self.decide(model)  # auto: sized from this model, then replicas or shards of its degrees
        strategy = self.strategy()
        if self.config.sync_batchnorm:  # before wrapping: DDP and FSDP2 then see the converted layers
            model = strategy.convert_sync_batchnorm(model)
        elif self.ctx.is_main_process:  # per-rank statistics: said once, with the fix
            unsynced = strategy.unsynced_batchnorm_warning(model)
            if unsynced is not None:
                warnings.warn(unsynced, stacklevel=4)
        shape = flops.transformer_shape(model)  # MFU: a transformer stack's FLOPs, on a GPU with a known peak
        self.throughput.set_model(
            shape and shape.flops_per_token,
            device_peaks.device_peak(self.ctx.device, self.choice.options.mixed_precision),
            share=self.plan().flops_share,
        )  # tp, cp and pp split the FLOPs
        tied = tied_names(model)  # before a pipeline cut leaves this rank one of a tied parameter's names
        model = self.checkpointer.track(strategy.setup_model(model, compiled), tied=tied)
        hook_state = ddp_options.hook_state_of(model)
        if hook_state is not None:  # PowerSGD's error feedback: per rank, so in each rank's file
            self.checkpointer.register(hook_state, per_rank=True)
        self.checkpointer.strategy_name = strategy.name
        self.callbacks.notify("on_model", strategy.unwrap(model))
        self.prepared.append(model)
        if self.step.pipeline(model) is None:  # a pipeline step marks its own phase
            watch_module(self.progress, model)
            shadow_rows.install(model, strategy.unwrap(model))  # a batch of no rows through transformers
        plan = self.plan()
        if self.config.average_tokens_across_ranks and plan.grad_size > 1 and plan.pp == 1:
            if token_mean.applies(strategy.unwrap(model)):  # labels=: the mean over every rank's targets
                token_mean.average_tokens_across_ranks(  # its pre-hook goes first, before the shadow row's
                    model, lambda: strategy.layout.group("grad"), plan.grad_size, self.step.weighed_by_tokens
                )
        return model

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        """px.prepare_optimizer."""
        strategy = self.strategy()
        inner = strategy.setup_optimizer(optimizer, model)
        if inner is not optimizer:
            self.replaced[id(optimizer)] = inner
        self.step.optimizers.append(inner)
        scaler = strategy.precision.scaler  # known once `auto` has decided, at prepare
        if scaler is not None and not any(obj is scaler for obj in self.checkpointer.objects):
            self.checkpointer.register(scaler)  # fp16: the loss scale is training state too
        inner.register_step_pre_hook(lambda *_: self.step.before_step())
        optimizer = self.checkpointer.track(
            wrap_optimizer(
                inner,
                self.step.accumulator,
                strategy,
                self.choice.gradient_clipping,
                before_step=self.step.before_step,
                wrap_closure=closure_wrapper(optimizer, strategy.plan, strategy.dp_group),
            )
        )
        user_state.answer_optimizer(optimizer, strategy.plan)  # its state_dict(): the full state, or refused
        self.prepared.append(optimizer)
        watch_optimizer(self.progress, optimizer)
        if self.profiler is not None:  # after the step counter's hook: it reads global_step
            self.profiler.attach(base_optimizer(optimizer))
        return optimizer

    def scheduler(self, scheduler: Any) -> lr_scheduler.PreparedScheduler:
        """px.prepare_scheduler."""
        lr_scheduler.rebind(scheduler, self.replaced)
        prepared = lr_scheduler.PreparedScheduler(scheduler)
        self.checkpointer.register(prepared)
        self.prepared.append(prepared)  # under Join it leaves with the last joiner's state (data/join_state.py)
        return prepared

    def training(self) -> bool:
        """Whether a prepared model trains (one in train mode). No prepared model (a loader read on its
        own, an evaluation with a model of the script's): not, so batches keep DistributedSampler's shapes."""
        return any(m.training for m in self.prepared if isinstance(m, nn.Module))

    def data_loader(self, loader: DataLoader, shard: bool = True) -> PreparedLoader:
        """px.prepare_data_loader."""
        split_batches = self.config.split_batches
        per_rank = loader.batch_size  # as the script wrote it (split_batches: divided below)
        loader = scale_batch(loader, self.callbacks.loader_scale(split_batches))  # parity: the global batch
        prepared = PreparedLoader(
            loader,
            self.ctx,
            seed=self.seed,
            device_placement=self.device_placement(),
            batch_records=self.records,
            shard=shard,
            progress=self.progress,
            rank_aware_workers=self.config.worker_seeds == "per_rank",
            on_batch=self.throughput.count_batch if self.ctx.is_main_process else None,
            split_batches=split_batches,
            training=self.training,
            empty_padding=lambda: not self.plan().has(Needs.PIPELINE),
        )
        rank_batch = prepared.batch_size if split_batches else per_rank
        self.callbacks.notify("on_loader", prepared.batch_size if split_batches else loader.batch_size)
        if self.choice.deepspeed is not None:  # its micro batch is per rank: compare what a rank gets
            with refusal.refusing():  # the same on every rank: said once, exit 2, no traceback
                self.choice.deepspeed.check_loader(rank_batch)
        return self.checkpointer.track(prepared)
