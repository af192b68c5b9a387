"""Gradient accumulation: which micro-step syncs, the loss scale, and the optimizer wrapper
whose `step()` / `zero_grad()` act only when a full accumulation cycle is done."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch

from phalanx.logging.rank_log import get_logger
from phalanx.loop.precision import Precision


REMAINDERS = ("flush", "drop")


class Accumulator:
    """Counts micro-steps of `grad_accum_steps` and says when gradients must be synchronised.

    `with accumulate(model):` marks one micro-step. On the non-final micro-steps of a cycle the
    strategy's `no_sync` skips the gradient all-reduce / reduce-scatter, and `backward` divides the
    loss by the cycle's length so that k micro-batches of size b equal one batch of size k*b.

    `batches_left()` (the prepared loader's count of batches left in its pass, this one included;
    None when unknown) ends cycles at the end of an epoch: with `remainder="flush"` (default) the
    last, shorter cycle steps the optimizer on the epoch's last batch, its loss divided by its own
    length (as one smaller batch would be); with "drop" its gradients are discarded, no step.
    """

    def __init__(
        self,
        num_steps: int = 1,
        remainder: str = "flush",
        batches_left: Callable[[], int | None] | None = None,
        on_cycle_start: Callable[[], None] | None = None,
    ):
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"grad_accum_steps must be a positive integer, got {num_steps!r}")
        if remainder not in REMAINDERS:
            raise ValueError(f"grad_accum_remainder must be one of {', '.join(REMAINDERS)}, got {remainder!r}")
        self.num_steps = int(num_steps)
        self.remainder = remainder
        self.batches_left = batches_left
        self.on_cycle_start = on_cycle_start  # forgets what a dropped cycle left (num_items counts)
        self.micro_step = 0  # micro-steps begun so far
        self.cycle_pos = 0  # micro-steps done in the current cycle
        self.cycle_len = self.num_steps  # micro-steps the current cycle has (fewer at an epoch's end)
        self.dropping = False  # the current cycle is an epoch's remainder, to be discarded
        self.sync_gradients = True  # True on the final micro-step of a cycle (always when k == 1)
        self.inside = False
        self.holding_grads = False  # gradients of an unfinished cycle are held: zero_grad must wait
        self.warned_outside = False

    def _begin_micro_step(self) -> None:
        self.micro_step += 1
        if self.cycle_pos == 0:
            if self.on_cycle_start is not None:
                self.on_cycle_start()
            left = self.batches_left() if self.batches_left is not None else None
            short = left is not None and 0 < left < self.num_steps
            self.cycle_len = left if short else self.num_steps
            self.dropping = short and self.remainder == "drop"
        self.cycle_pos += 1
        last = self.cycle_pos == self.cycle_len
        self.sync_gradients = last and not self.dropping
        if last:
            self.cycle_pos = 0

    @contextlib.contextmanager
    def accumulate(self, no_sync: Callable[[], ContextManager[Any]]) -> Iterator[None]:
        self._begin_micro_step()
        self.inside = True
        try:
            with contextlib.nullcontext() if self.sync_gradients else no_sync():
                yield
        finally:
            self.inside = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.num_steps == 1:
            return loss
        return loss / self.loss_divisor()

    def loss_divisor(self) -> int:
        """What this micro-step's loss is divided by (its cycle's length); a backward outside
        `accumulate` counts as a micro-step."""
        if self.num_steps == 1:
            return 1
        if not self.inside:
            # A script written without px.accumulate (the config file asked for accumulation): each
            # backward is a micro-step. Gradients are synced on every one (the forward ran outside
            # no_sync), which costs traffic but gives the same result.
            self._begin_micro_step()
            if not self.warned_outside:
                self.warned_outside = True
                get_logger("accumulation").info(
                    "grad_accum_steps=%d: each backward() counts as a micro-step; wrap the forward and "
                    "backward in `with px.accumulate(model):` to skip the gradient sync on the first %d",
                    self.num_steps,
                    self.num_steps - 1,
                )
        # A dropped remainder's last micro-step lets zero_grad() discard what it accumulated.
        self.holding_grads = not (self.dropping and self.cycle_pos == 0)
        return self.cycle_len

    def when_syncing(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call `fn` on the final micro-step only (partial, unsynced gradients are not clipped)."""
        return fn(*args, **kwargs) if self.sync_gradients else None


_DELEGATED = (
    "register_step_pre_hook",
    "register_step_post_hook",
    "register_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "register_load_state_dict_pre_hook",
    "register_load_state_dict_post_hook",
    "add_param_group",
)


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer (possibly rebuilt by the strategy), stepped only on sync micro-steps.

    It is an `Optimizer` for isinstance checks and LR schedulers; `param_groups`, `state`,
    `defaults`, `state_dict()` and `load_state_dict()` are the wrapped optimizer's own.
    `zero_grad()` is skipped while an unfinished cycle's gradients are held, so it may be called
    before the forward or after `step()`: both orders accumulate correctly.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulator: Accumulator,
        precision: Precision,
        clip: Callable[[], Any] | None = None,
        before_step: Callable[[], None] | None = None,
        wrap_closure: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None,
    ):
        # No super().__init__: this object owns no parameters; the wrapped optimizer does.
        self.optimizer = optimizer
        self.accumulator = accumulator
        self.precision = precision
        self.clip = clip  # called before each real step (DeepSpeed's gradient_clipping)
        # The step's gradient rescale (num_items): before clipping, and before fp16's scaler may skip
        # the step (a skipped step's counts must not leak into the next one).
        self.before_step = before_step
        # Replicas whose optimizer reads the closure's loss (LBFGS): the loss averaged over them
        self.wrap_closure = wrap_closure

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if not self.accumulator.sync_gradients:
            return None
        if self.before_step is not None:
            self.before_step()
        if self.clip is not None:
            self.precision.unscale_(self.optimizer)
            self.clip()
        if closure is not None and self.wrap_closure is not None:
            closure = self.wrap_closure(closure)
        result = self.precision.step(self.optimizer, closure)
        self.accumulator.holding_grads = False
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.accumulator.num_steps > 1 and self.accumulator.holding_grads:
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally (e.g. ZeroRedundancyOptimizer's own).
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: PreparedOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.optimizer, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in _DELEGATED:
    setattr(PreparedOptimizer, _name, _delegate(_name))


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(optimizer, PreparedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def wrap_optimizer(
    optimizer: torch.optim.Optimizer,
    accumulator: Accumulator,
    strategy: Any,
    clip_norm: float | None = None,
    before_step: Callable[[], None] | None = None,
    wrap_closure: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None,
) -> torch.optim.Optimizer:
    """`optimizer` itself when nothing needs adding (no accumulation, scaler, auto-clipping or
    closure to wrap), else a PreparedOptimizer around it."""
    precision: Precision = strategy.precision

    def clip_all() -> torch.Tensor:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return strategy.clip_grad_norm_(params, clip_norm)

    clip = clip_all if clip_norm is not None else None
    if accumulator.num_steps == 1 and precision.scaler is None and clip is None and wrap_closure is None:
        return optimizer
    return PreparedOptimizer(optimizer, accumulator, precision, clip, before_step, wrap_closure)
