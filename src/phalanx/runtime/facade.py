"""`Phalanx`: the object a training script talks to. It delegates; strategies do the work."""
from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from phalanx import config, envvars
from phalanx.checkpoint.manager import Checkpointer
from phalanx.data.loader import BatchInfo, PreparedLoader
from phalanx.logging import session as log_session
from phalanx.logging.rank_log import get_logger
from phalanx.runtime import collectives, uneven, watchdog
from phalanx.runtime import debug as debug_mode
from phalanx.runtime.context import DistContext
from phalanx.runtime.process_group import destroy_process_group, init_process_group
from phalanx.runtime.progress import Progress, watch_module, watch_optimizer
from phalanx.runtime.uneven import UnevenInputs
from phalanx.strategies import memory, registry, settings
from phalanx.strategies.accumulation import Accumulator, wrap_optimizer
from phalanx.strategies.base import Strategy, StrategyOptions


class Phalanx:
    """Reads the launcher's environment, joins the process group, and prepares training objects.

    `Phalanx()` under plain `python train.py` is a world of one with no process group; under
    `phalanx run` or `torchrun` it is one rank of many. The script is the same.
    """

    def __init__(
        self,
        strategy: str | None = None,
        *,
        mixed_precision: str | None = None,
        grad_accum_steps: int | None = None,
        deepspeed: str | os.PathLike | dict | None = None,
        strategy_options: dict[str, Any] | StrategyOptions | None = None,
        seed: int | None = None,
        cpu: bool = False,
        device_placement: bool = True,
        collective_timeout: float | None = None,
        watchdog_timeout: float | None = None,
        debug: bool | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_keep: int = 3,
        checkpoint_async: bool = False,
    ):
        """`strategy`: dp, ddp, zero1, zero2, zero3 (= fsdp), hsdp or auto (default).
        `mixed_precision`: no, bf16 or fp16. `grad_accum_steps`: micro-steps per optimizer step
        (use with `px.accumulate`). `deepspeed`: a DeepSpeed JSON config (path or dict) mapped onto
        these settings. `strategy_options`: fields of `StrategyOptions` (cpu_offload,
        shard_modules, forward_prefetch, replicate_size and shard_size for hsdp, memory_budget_bytes,
        extra). Each falls back to its PHALANX_* environment variable, as set by `phalanx run`.
        """
        self.ctx = DistContext.from_env(cpu=cpu)
        self.settings = settings.resolve(strategy, mixed_precision, grad_accum_steps, deepspeed, strategy_options)
        if self.settings.deepspeed is not None:
            self.settings.deepspeed.check_world(self.ctx.world_size)
        self.seed = int(seed if seed is not None else os.environ.get(envvars.PHALANX_SEED, 0))
        self.device_placement = device_placement
        registry.resolve_name(self.settings.strategy, self.ctx)  # bad names fail before any group is joined
        self.debug = debug_mode.resolve_debug(debug)  # check each collective's shapes across ranks first
        watchdog_timeout = watchdog.resolve_timeout(watchdog_timeout)  # 0 = off
        init_process_group(self.ctx, collective_timeout)
        self.strategy: Strategy = registry.create(self.settings.strategy, self.ctx, self.settings.options)
        self._accumulator = Accumulator(self.settings.grad_accum_steps)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._batch_info = BatchInfo()
        self._step_progress = Progress()  # step and phase of this rank, read by the watchdog
        self._prepared: list[Any] = []  # models and optimizers, for join()/uneven_inputs()
        self.watchdog = watchdog.start_watchdog(self.ctx.rank, self.ctx.world_size, self._step_progress,
                                                watchdog_timeout, destroy_process_group)
        self._checkpointer = Checkpointer(
            strategy_name=self.strategy.name, seed=self.seed, keep=checkpoint_keep, async_save=checkpoint_async,
            directory=checkpoint_dir or os.environ.get(envvars.PHALANX_CHECKPOINT_DIR) or None,
        )
        self._logging = log_session.start(self.ctx.rank, self.is_main_process, collectives.broadcast_object)
        get_logger().info("rank %d of %d on %s, strategy %s, run dir %s", self.rank, self.world_size,
                          self.device, self.strategy_name, self.run_dir)

    @classmethod
    def from_config(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> "Phalanx":
        """Build from a YAML config file; precedence file < PHALANX_* env < keyword overrides.

        Settings `Phalanx()` takes as arguments are passed; the rest are exported as their
        PHALANX_* variables for the modules that read them (as `phalanx run --config` does).
        """
        kwargs, exported = config.runtime_kwargs(path, os.environ, overrides, inspect.signature(cls).parameters)
        os.environ.update(exported)
        return cls(**kwargs)

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
        return self.strategy.name

    # ---- preparing -------------------------------------------------------------------------
    def prepare(self, *objects: Any, shard: bool = True) -> Any:
        """Prepare models, optimizers and data loaders, in any number and order.

        Returns them in the order given (a single object when one was passed). Models are
        prepared first, so an optimizer can be bound to the model's wrapped parameters.
        `shard=False`: the loaders hold data already split per rank; use it as is.
        """
        prepared: list[Any] = list(objects)
        models = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
        for i in models:
            prepared[i] = self.prepare_model(objects[i])
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                model = prepared[models[0]] if len(models) == 1 else None
                prepared[i] = self.prepare_optimizer(obj, model)
            elif isinstance(obj, DataLoader):
                prepared[i] = self.prepare_data_loader(obj, shard=shard)
            elif not isinstance(obj, nn.Module) and hasattr(obj, "load_state_dict"):  # LR scheduler, grad scaler
                self.register_for_checkpointing(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = self._checkpointer.track(self.strategy.setup_model(model))
        self._checkpointer.strategy_name = self.strategy.name  # `auto` has decided by now
        self._prepared.append(model)
        watch_module(self._step_progress, model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The strategy's optimizer (rebound to sharded parameters under zero2/zero3, a
        ZeroRedundancyOptimizer under zero1) inside a wrapper that steps once per accumulation cycle."""
        inner = self.strategy.setup_optimizer(optimizer, model)
        self._optimizers.append(inner)
        scaler = self.strategy.precision.scaler  # known once `auto` has decided, at prepare
        if scaler is not None and not any(obj is scaler for obj in self._checkpointer.objects):
            self._checkpointer.register(scaler)  # fp16: the loss scale is training state too
        optimizer = self._checkpointer.track(
            wrap_optimizer(inner, self._accumulator, self.strategy, self.settings.gradient_clipping))
        self._prepared.append(optimizer)
        watch_optimizer(self._step_progress, optimizer)
        return optimizer

    def prepare_data_loader(self, loader: DataLoader, shard: bool = True) -> PreparedLoader:
        if self.settings.deepspeed is not None:
            self.settings.deepspeed.check_loader(loader.batch_size)
        return self._checkpointer.track(PreparedLoader(
            loader, self.ctx, seed=self.seed, device_placement=self.device_placement,
            batch_info=self._batch_info, shard=shard, progress=self._step_progress))

    # ---- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, divided by grad_accum_steps and scaled for fp16 when needed."""
        with self._step_progress.during("backward"):
            self.strategy.backward(self._accumulator.scale_loss(loss))

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self.strategy.no_sync(model)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip by the global gradient norm over all ranks (sharded strategies too) and return
        it as a plain tensor; None on non-final accumulation micro-steps (nothing to clip yet)."""
        if isinstance(parameters, nn.Module):
            parameters = parameters.parameters()
        return self._accumulator.when_syncing(self._clip, list(parameters), max_norm, norm_type)

    def _clip(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        for opt in self._optimizers:  # fp16: clip the true gradients, not the scaled ones
            self.strategy.precision.unscale_(opt)
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return self.strategy.unwrap(model)

    # ---- strategies: accumulation, clipping, precision, full weights ------------------------
    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """One micro-step: gradients sync (and the optimizer steps) on every grad_accum_steps-th."""
        return self._accumulator.accumulate(lambda: self.strategy.no_sync(model))

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
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        return memory.measure(model, optimizer)

    # ---- checkpoints (phalanx.checkpoint) -------------------------------------------------------
    def save_state(self, path: str | os.PathLike | None = None, *, async_save: bool | None = None) -> str:
        """Save model, optimizer, data position, RNG, counters and registered objects; return the path.

        Without `path`, writes the next `step-XXXXXXXX` checkpoint under `checkpoint_dir`.
        """
        with self.busy("save_state"):  # writing can outlast the watchdog timeout on some ranks
            return str(self._checkpointer.save(path, async_save))

    def load_state(self, path: str | os.PathLike | None = None) -> bool:
        """Restore the latest intact checkpoint (or `path`); False, changing nothing, when there is none.

        Call it after `prepare(...)`: one script then both starts and resumes.
        """
        with self.busy("load_state"):
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

    # ---- talking across ranks ----------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def reduce(self, data: Any, reduction: str = "mean") -> Any:
        with self._step_progress.during("reduce"):
            return collectives.reduce(data, reduction, debug=self.debug)

    def gather(self, data: Any) -> Any:
        with self._step_progress.during("gather"):
            return collectives.gather(data, debug=self.debug)

    def gather_for_metrics(self, data: Any) -> Any:
        """Gather like `gather`, without the repeats the sampler added to even out the ranks.

        Inside a loop over a prepared loader, this rank's padding samples are cut from the
        current batch before gathering, so an eval over N items yields exactly N. Python lists
        (e.g. predicted strings) are gathered as objects and flattened.
        """
        size, real = self._batch_info.size, self._batch_info.num_real
        trim = size is not None and real is not None and real < size

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[:real] if trim and t.dim() > 0 and t.shape[0] == size else t

        with self._step_progress.during("gather_for_metrics"):
            if isinstance(data, list) and not any(isinstance(x, torch.Tensor) for x in data):
                mine = data[:real] if trim and len(data) == size else data
                return [x for part in collectives.gather_object(mine, debug=self.debug) for x in part]
            return collectives.gather(collectives.map_tensors(cut, data), debug=self.debug)

    def wait_for_everyone(self) -> None:
        """Barrier across all ranks (no-op in a world of one)."""
        with self._step_progress.during("barrier"):
            collectives.barrier(debug=self.debug)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Let the main process run the block first (e.g. to download or cache a dataset)."""
        if not self.is_main_process:
            self.wait_for_everyone()
            yield
            return
        with self.busy("main_process_first"):  # the others wait on purpose: not a stall
            yield
        self.wait_for_everyone()

    # ---- lockstep safety: uneven inputs, watchdog, debug -------------------------------------
    def uneven_inputs(self, *objects: Any, method: str = "auto") -> UnevenInputs:
        """Context for data whose length differs per rank: torch's Join where it applies, else a
        step-level agreement. No objects: every model and optimizer this Phalanx prepared."""
        return uneven.uneven_inputs(objects or self._prepared, self.ctx, method, self._step_progress)

    def join(self, *objects: Any) -> UnevenInputs:
        """torch's Join over the prepared (Joinable) models/optimizers; ValueError where it cannot apply."""
        return uneven.uneven_inputs(objects or self._prepared, self.ctx, "join", self._step_progress)

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

    def add_sink(self, sink: Any) -> None:
        """Send `px.log` rows also to `sink` (an object with `write(step, metrics)` and `close()`)."""
        self._logging.metrics.add_sink(sink)

    def progress(self, iterable: Any, **kwargs: Any) -> Any:
        """Iterate with a progress bar (steps/s, ETA, latest logged metrics) on the main process
        when stdout is a terminal; elsewhere just iterate. kwargs: total, desc, enabled, tqdm's."""
        return self._logging.progress(iterable, **kwargs)
