"""`Phalanx`: the object a training script talks to. It delegates; strategies do the work."""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import across_ranks, config
from phalanx.data.batch_records import BatchRecords
from phalanx.data.loader import PreparedLoader
from phalanx.logging.rank_log import get_logger
from phalanx import preparing, services, stepping
from phalanx.config.names import Needs
from phalanx.runtime import parity_record, seeding
from phalanx.runtime.context import (
    AgentEnv,
    DistContext,
    handed_plan,
    launcher_settings,
    mark_phalanx_created,
    parity_request,
)
from phalanx.runtime.process_group import init_process_group
from phalanx.runtime.step_tracker import Phase, StepTracker
from phalanx.data import uneven
from phalanx.data.uneven import UnevenInputs
from phalanx.model import memory
from phalanx.model import meta_init
from phalanx.model import load_model as model_loading
from phalanx.loop import scheduler as lr_scheduler
from phalanx.loop.callbacks import LoopCallbacks
from phalanx.strategies import setup
from phalanx.strategies.base import Strategy
from phalanx.strategies.choice import choose
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.context import attention as cp_attention


class Phalanx:
    """Reads the launcher's environment, joins the process group, and prepares training objects.

    `Phalanx()` under plain `python train.py` is a world of one (a gloo group of its one rank, for
    what the script asks of torch.distributed itself: runtime/process_group.py); under
    `phalanx run` or `torchrun` it is one rank of many. The script is the same.
    """

    def __init__(
        self,
        strategy: str | None = None,
        *,
        strategy_options: dict[str, Any] | StrategyOptions | None = None,
        config_file: str | os.PathLike | None = None,
        **settings: Any,
    ):
        """Every setting of phalanx's schema (`phalanx.config.SETTINGS`) is a keyword argument here;
        one left out (or None) comes from its PHALANX_* variable (as `phalanx run` sets them), then
        from `config_file` (a YAML file), then its default. `strategy_options`: fields of
        `StrategyOptions` (cpu_offload, shard_modules, forward_prefetch, extra), Python only.
        """
        mark_phalanx_created()  # under `phalanx run`: its settings reached this script
        layers = [config.from_yaml_runtime(config_file)] if config_file is not None else []
        resolved = config.resolve(*layers, launcher_settings(), config.from_kwargs({"strategy": strategy, **settings}))
        cfg = self.config = resolved.config
        self.ctx = DistContext.from_env(cpu=cfg.cpu)
        self.settings = choose(resolved, strategy_options)
        # A given seed seeds Python/NumPy/torch alike on every rank (identical models); without one,
        # the data order and worker seeds use the setting's default (0), and the global RNGs are
        # left alone (the script may have seeded them itself).
        self.seed = 0 if cfg.seed is None else cfg.seed
        if cfg.seed is not None:
            seeding.seed_everything(self.seed)
        self.device_placement = cfg.device_placement
        self._resolved = resolved
        # the job's one plan: the launcher's when these settings ask for it, else built here, once;
        # strategy auto's is the plan of its degrees until it decides (at prepare, from the model)
        self._plan = setup.job_plan_for(self.settings, resolved, self.ctx, handed_plan())
        self.debug = cfg.debug  # check each collective's shapes across ranks first
        init_process_group(self.ctx, cfg.collective_timeout)
        self._strategy: Strategy | None = None
        self.ctx = self.ctx.with_data_parallel(self._plan)  # auto's replicas or shards: the same data shards
        if not setup.undecided(self.settings, self._plan):
            self._adopt(setup.adopt(self._plan, self.ctx, cfg, self.settings, self._before_clip))
        if self.settings.deepspeed is not None:  # its batch identity counts data-parallel ranks
            self.settings.deepspeed.check_world(self.ctx.dp_size)
        self._batch_records = BatchRecords()  # each prepared loader's own record of its last batch
        self._step_progress = StepTracker()  # step and phase of this rank, read by the watchdog
        self._step = stepping.Stepping(
            strategy=lambda: self.strategy,
            decided=lambda: self._strategy,
            grad_size=self._plan.grad_size,
            device=self.ctx.device,
            accumulation=(self.settings.grad_accum_steps, self.settings.grad_accum_remainder),
            records=self._batch_records,
            progress=self._step_progress,
            next_step=lambda: self.global_step + 1,
            notify=lambda *args: self._callbacks.notify(*args),
        )
        self._items, self._accumulator = self._step.items, self._step.accumulator
        self._optimizers = self._step.optimizers
        self._start_services(cfg)
        self._preparing = preparing.Preparing(
            strategy=lambda: self.strategy,
            decide=self._decide,
            plan=lambda: self._plan,
            config=cfg,
            choice=self.settings,
            ctx=self.ctx,
            seed=self.seed,
            device_placement=lambda: self.device_placement,
            step=self._step,
            records=self._batch_records,
            progress=self._step_progress,
            checkpointer=self._checkpointer,
            callbacks=self._callbacks,
            throughput=self._logging.throughput,
            profiler=self._profiler,
        )
        self._prepared = self._preparing.prepared  # models, optimizers and schedulers, for join()/uneven_inputs()
        self._announce(resolved)

    def _start_services(self, cfg: Any) -> None:
        """px.print/reduce/gather's door to the data-parallel ranks, what runs beside the loop
        (services.py), and the loop's one callback list."""
        self._talk = across_ranks.RankTalk(
            self._step_progress,
            self._batch_records,
            self.ctx.device,
            self.is_main_process,
            group=lambda: self._group("dp"),
            debug=lambda: self.debug,
        )
        running = services.start(
            self.ctx,
            cfg,
            self._plan,
            self._step_progress,
            strategy_name=self.strategy_name,
            seed=self.seed,
            cycle_idle=lambda: self._accumulator.cycle_pos == 0,
            save_now=self._save_now,
        )
        self.watchdog, self._checkpointer, self._preemption = running.watchdog, running.checkpointer, running.preemption
        self._deferred_save, self._logging = running.deferred_save, running.logging
        self._observe, self._profiler = running.observe, running.profiler
        self._logging.metrics.params = self._run_params
        # what hooks into the loop (parity's recorder, the throughput meter): one list, called at fixed points
        self._callbacks = LoopCallbacks(
            parity_record.from_request(parity_request(), self.rank, self.world_size), self._logging.throughput
        )

    def _announce(self, resolved: Any) -> None:
        """The start line; on the main process first, each setting two sources gave differently."""
        if self.is_main_process:  # two sources, two values: say which won and how to change it
            for line in config.override_lines(resolved, launcher=AgentEnv.from_env().phalanx_launcher):
                get_logger().warning("%s", line)
        get_logger().info(
            "rank %d of %d on %s, strategy %s, run dir %s%s",
            self.rank,
            self.world_size,
            self.device,
            "auto (decided at prepare(model), when the model is known)"
            if self.strategy_name == setup.AUTO
            else self.strategy_name,
            self.run_dir,
            self._logging.open_hint,
        )

    @classmethod
    def from_config(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> "Phalanx":
        """`Phalanx(config_file=path, **overrides)`: precedence file < PHALANX_* env < keyword overrides.

        Launcher keys in the file (nproc_per_node, ...) are allowed and ignored here.
        """
        return cls(config_file=path, **overrides)

    # ---- who am I --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_main_process(self) -> bool:
        return self.ctx.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.ctx.is_local_main_process

    @property
    def strategy_name(self) -> str:
        """The strategy in use; "auto" until prepare(model) has decided."""
        return setup.AUTO if self._strategy is None else self._strategy.name

    @property
    def plan(self) -> ParallelPlan:
        """The parallel plan this job runs: degrees of each mesh dimension, what is sharded."""
        return self.strategy.plan

    @property
    def mesh(self) -> Any:
        """The DeviceMesh with named dims (pp, dp_replicate, dp_shard, cp, tp); None in a world of one."""
        return self.strategy.mesh

    @property
    def dp_size(self) -> int:
        """Ranks that read different data (world_size / (tp x pp)); prepared loaders shard over them."""
        return self.ctx.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (the shard of the data it reads)."""
        return self.ctx.dp_rank

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks each row's sequence is cut over (1: no cut, or auto still undecided)."""
        return 1 if self._strategy is None else self._strategy.context.size

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group: it holds chunks cp_rank and 2cp-1-cp_rank."""
        return 0 if self._strategy is None else self._strategy.context.rank

    def shard_sequence(
        self, inputs: Any, targets: Any = None, *, pad: bool = False, seq_dim: int = 1
    ) -> tuple[Any, Any]:
        """This rank's part of a batch under cp, for hand-written loops (px.forward_backward cuts its
        own): see strategies/context/step.py `ContextParallel.shard`; active until px.backward."""
        return self.strategy.context.shard(inputs, targets, pad=pad, seq_dim=seq_dim)[:2]

    attention = staticmethod(cp_attention)  # px.attention(q, k, v, ...): attention across the cp cut

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            raise RuntimeError(
                "strategy 'auto' decides when the model is prepared. HINT: call px.prepare(model, ...) first."
            )
        return self._strategy

    def _group(self, name: str) -> Any:
        """A group of the strategy's layout ("dp", "grad"); None (every rank) until auto decides."""
        return None if self._strategy is None else self._strategy.layout.group(name)

    def _adopt(self, strategy: Strategy) -> None:
        """Run `strategy` (its plan's mesh and groups built by every rank together, strategies/setup.py)."""
        self._plan, self._strategy = strategy.plan, strategy

    def _decide(self, model: nn.Module) -> None:
        """Strategy auto: sized from this model, then replicas or shards of its degrees (once)."""
        if self._strategy is None:
            self._adopt(
                setup.decide(model, self.ctx, self.config, self.settings, self._plan, self._resolved, self._before_clip)
            )

    def _before_clip(self) -> None:
        """torch's clip_grad_norm_ on a prepared model prepares the gradients as px.clip_grad_norm_ (on its syncing step)."""
        self._step.before_clip()

    # ---- preparing -------------------------------------------------------------------------
    def prepare(self, *objects: Any, shard: bool = True) -> Any:
        """Prepare models, optimizers and data loaders, in any number and order.

        Returns them in the order given (a single object when one was passed). Models are
        prepared first, so an optimizer can be bound to the model's wrapped parameters.
        `shard=False`: the loaders hold data already split per rank (or a stream that splits itself in a
        way phalanx does not see); use it as is (docs/data.md).
        """
        return self._preparing.prepare(objects, shard)

    def init_module(self) -> contextlib.AbstractContextManager[None]:
        """Build the model inside: on the meta device when the plan shards parameters (zero2, zero3,
        hsdp, tensor parallel) or cuts pipeline stages (pp > 1): prepare then allocates and
        initialises only this rank's shards or stages, with the values one process would draw; and
        under auto (which sizes the model before choosing). On `px.device` otherwise."""
        on_meta = self._strategy is None or self.strategy.plan.builds_on_meta
        return meta_init.init_module(on_meta, self.device)

    def load_model(self, model: nn.Module, source: Any, *, strict: bool = True) -> model_loading.LoadResult:
        """Load a full checkpoint (safetensors file or sharded index, torch file, or a state dict on
        rank 0) into a prepared model; under zero2/zero3 no rank holds more than its shards plus
        one tensor. Missing/unexpected keys or shape mismatches load nothing unless strict=False.
        Under pp each rank reads its own stages' tensors from a safetensors file (other sources refused)."""
        with self.busy(Phase.LOAD_MODEL):
            return model_loading.load_model(
                self.unwrap_model(model), source, strict=strict, rank=self.rank, elsewhere=self.strategy.stage_filter()
            )

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model through the strategy (strategy auto decides from it first)."""
        return self._preparing.model(model)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None
    ) -> torch.optim.Optimizer:
        """The strategy's optimizer (rebound to sharded parameters under zero2/zero3, a
        ZeroRedundancyOptimizer under zero1) inside a wrapper that steps once per accumulation cycle."""
        return self._preparing.optimizer(optimizer, model)

    def prepare_scheduler(self, scheduler: Any) -> lr_scheduler.PreparedScheduler:
        """The scheduler, bound to the prepared optimizer, stepping only after a real optimizer step
        (accumulation boundaries, fp16 steps not skipped); checkpointed with the rest."""
        return self._preparing.scheduler(scheduler)

    def prepare_data_loader(self, loader: DataLoader, shard: bool = True) -> PreparedLoader:
        """This rank's shard of `loader`; with split_batches, `loader.batch_size` is the global batch."""
        return self._preparing.data_loader(loader, shard)

    # ---- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, num_items: int | torch.Tensor | None = None) -> None:
        """`loss.backward()`, divided by grad_accum_steps and scaled for fp16 when needed.

        `num_items`: `loss` is a sum over that many items (target tokens, samples; 0 is fine on some
        ranks); the optimizer step then uses Σ loss / Σ num_items over every rank and micro-step, as
        one process would on the whole global batch (`px.step_loss` is that mean, for logging).
        After px.shard_sequence it is still the batch's count, as in px.forward_backward.
        """
        self._step.backward(loss, num_items)

    @property
    def moe_dropped_tokens(self) -> dict[str, int]:
        """ep with a capacity factor: the token-choices each MoE layer dropped in the last optimizer
        step (its micro-steps and every copy of the experts summed); {} without one (docs/moe.md)."""
        return self.strategy.dropped_tokens()

    @property
    def step_loss(self) -> float | None:
        """Σ loss / Σ num_items of the last optimizer step over all ranks and micro-steps (the global
        token-weighted mean, free: it rides on the step's one all-reduce); None until a step used
        `px.backward(loss, num_items=...)`."""
        return self._items.step_loss

    def forward_backward(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        num_items: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One batch through every layout: `model(inputs)` (a tuple is unpacked, a dict passed as
        keywords), `loss_fn(output, targets)`, and `px.backward` of it. Returns the loss, detached:
        the same value on every rank of a tensor-parallel group. Write training loops with it: the
        same loop runs every layout.

        Under pp > 1 it runs the pipeline schedule over this batch (the same on every rank of the
        pipeline; one tensor of inputs), cut into pp_microbatches microbatches, and returns the loss,
        the mean over the microbatches, on every rank of the pipeline. `loss_fn` must average over
        the samples it is given.

        `num_items` (as in `px.backward`, every layout, pp included): `loss_fn` *sums* over the items
        (target tokens) it is given and `num_items` counts this batch's; the step then uses Σ loss /
        Σ num_items over every rank and micro-step. The returned loss is the batch's sum."""
        return self._step.forward_backward(model, inputs, targets, loss_fn, num_items)

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """`model(inputs)` (a tuple unpacked, a dict passed as keywords) in every layout, for
        evaluation. Under pp > 1: the last stage's output, computed without gradients over the
        pipeline's stages, on every rank of the pipeline (any batch size: it is cut into as many
        equal microbatches as divide it, up to pp_microbatches); the V schedules cannot run it."""
        return self._step.forward(model, inputs)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.strategy.no_sync(model)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by the global gradient norm over all ranks (sharded strategies too) and return
        it as a plain tensor; None on non-final accumulation micro-steps (nothing to clip yet)."""
        return self._step.clip_grad_norm_(parameters, max_norm, norm_type)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return self.strategy.unwrap(model)

    # ---- strategies: accumulation, clipping, precision, full weights ------------------------
    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step: gradients sync (and the optimizer steps) on every grad_accum_steps-th."""
        return self._step.accumulate(model)

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step whose optimizer.step() really steps."""
        return self._accumulator.sync_gradients

    @property
    def grad_accum_steps(self) -> int:
        return self._accumulator.num_steps

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast for code outside the model's forward (the model's forward is already covered)."""
        return self.strategy.precision.autocast()

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's full, unsharded weights, with the user's parameter names, under every
        strategy. On the main process always; other ranks get {} under zero2/zero3 (gathering N
        full copies would defeat sharding) and the same full dict under replicated strategies."""
        return self.strategy.full_state_dict(model)

    def memory_report(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> memory.RankBytes:
        """Bytes of parameters, gradients, optimizer state and kept buffers this rank holds now, and
        the runtime's own (on CPU; `runtime`): what the process holds between steps."""
        return memory.measure(model, optimizer, runtime=memory.runtime_bytes(self.ctx.device.type))

    # ---- checkpoints (phalanx.checkpoint) -------------------------------------------------------
    def save_state(self, path: str | os.PathLike | None = None, *, async_save: bool | None = None) -> str:
        """Save model, optimizer, data position, RNG, counters and registered objects; return the path.

        Without `path`, writes the next `step-XXXXXXXX` checkpoint under `checkpoint_dir`. Called in
        the middle of a gradient-accumulation cycle, it warns and saves after the cycle's optimizer
        step, at the next step boundary, returning that checkpoint's path (checkpoint/deferred.py).
        """
        if self._accumulator.cycle_pos != 0:  # the cycle's gradients are not in the model yet
            return self._deferred_save.request(
                path, async_save, self._accumulator.cycle_pos, self._accumulator.cycle_len
            )
        self._deferred_save.pending = None  # a save at a boundary supersedes one asked for mid-cycle
        return self._save_now(path, async_save)

    def _save_now(self, path: str | os.PathLike | None, async_save: bool | None) -> str:
        with self.busy(Phase.SAVE_STATE):  # writing can outlast the watchdog timeout on some ranks
            return str(self._checkpointer.save(path, async_save))

    def load_state(self, path: str | os.PathLike | None = None) -> bool:
        """Restore the latest intact checkpoint (or `path`); False, changing nothing, when there is none.

        Call it after `prepare(...)`: one script then both starts and resumes.
        """
        with self.busy(Phase.LOAD_STATE):
            return self._checkpointer.load(path)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with state_dict()/load_state_dict() (schedulers, scalers, your own) in checkpoints."""
        for obj in objects:
            self._checkpointer.register(obj)

    def wait_for_checkpoint(self) -> None:
        """Block until an async `save_state` is published (the next save and exit also wait)."""
        self._checkpointer.wait()

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (restored by load_state)."""
        return self._checkpointer.global_step

    # ---- talking across ranks (across_ranks.py) ----------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only."""
        across_ranks.print_main(self._talk, *args, **kwargs)

    def reduce(self, data: Any, reduction: str = "mean") -> Any:
        """`data` (tensors, numbers, nested) reduced over the data-parallel ranks: across_ranks.reduce."""
        return across_ranks.reduce(self._talk, data, reduction)

    def gather(self, data: Any) -> Any:
        """`data` concatenated over the data-parallel ranks, in rank order: across_ranks.gather."""
        return across_ranks.gather(self._talk, data)

    def gather_for_metrics(self, data: Any, loader: PreparedLoader | None = None) -> Any:
        """`gather` without the samplers' repeats (an eval over N items yields N): across_ranks.gather_for_metrics."""
        return across_ranks.gather_for_metrics(self._talk, data, loader)

    def wait_for_everyone(self) -> None:
        """Barrier across all ranks (no-op in a world of one)."""
        across_ranks.wait_for_everyone(self._talk)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Let the main process run the block first (e.g. to download or cache a dataset)."""
        return across_ranks.main_process_first(self._talk)

    # ---- lockstep safety: uneven inputs, watchdog, debug -------------------------------------
    def uneven_inputs(self, *objects: Any, method: str = "auto") -> UnevenInputs:
        """Context for data whose length differs per rank: torch's Join where it applies (ddp, zero1),
        batches of no rows for a rank out of data under FSDP2, else (pp) a step-level agreement. No
        objects: every model and optimizer this Phalanx prepared."""
        return uneven.uneven_inputs(
            objects or self._prepared,
            self.ctx,
            method,
            self._step_progress,
            pipeline=self._plan.has(Needs.PIPELINE),
            prepared=self._prepared,
            layout=None if self._strategy is None else self.plan.describe(),
            group=self._group("dp"),
        )

    def join(self, *objects: Any) -> UnevenInputs:
        """torch's Join over the prepared (Joinable) models/optimizers; ValueError where it cannot apply."""
        return self.uneven_inputs(*objects, method="join")

    def busy(self, what: str = "busy") -> contextlib.AbstractContextManager[None]:
        """Mark long work on this rank that the others wait for on purpose (e.g. rank 0 saving a
        checkpoint while the rest wait at a barrier): the watchdog does not call it a stall."""
        return self._step_progress.busy_with(what)

    # ---- logging, metrics, progress ------------------------------------------------------------
    @property
    def run_dir(self) -> str:
        """This run's directory (metrics files, per-rank logs); the same path on every rank."""
        return self._logging.run_dir

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Log scalar metrics from the main process to the console and the sinks (CSV, JSONL...).

        Other ranks' calls are ignored: reduce first (`px.reduce`) to log a global value.
        """
        self._logging.log(values, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record hyper-parameters (lr, epochs, ...) with the trackers, beside phalanx's own settings."""
        self._logging.metrics.log_hyperparams(params)

    def _run_params(self) -> dict[str, Any]:
        """The run's settings, logged by the trackers as hyper-parameters when they open."""
        return {
            **{s.name: getattr(self.config, s.name) for s in config.RUNTIME},
            "strategy": self.strategy_name,
            "world_size": self.world_size,
            "mixed_precision": self.settings.options.mixed_precision,
            "grad_accum_steps": self.grad_accum_steps,
            "seed": self.seed,
            "run_dir": self.run_dir,
        }

    def add_sink(self, sink: Any) -> None:
        """Send `px.log` rows also to `sink` (an object with `write(step, metrics)` and `close()`)."""
        self._logging.metrics.add_sink(sink)

    def progress(self, iterable: Any, **kwargs: Any) -> Any:
        """Iterate with a progress bar (steps/s, ETA, latest logged metrics) on the main process
        when stdout is a terminal; elsewhere just iterate. kwargs: total, desc, enabled, tqdm's."""
        return self._logging.progress(iterable, **kwargs)


# `Phalanx`'s signature as help() and IDEs show it: the fixed arguments, then every runtime setting
setattr(Phalanx.__init__, "__signature__", config.with_settings(inspect.signature(Phalanx.__init__)))
