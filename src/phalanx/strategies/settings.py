"""One place that turns Phalanx() arguments, PHALANX_* variables and a DeepSpeed config into the
settings a strategy is built from. Precedence: argument > environment variable > DeepSpeed config >
default; an argument/variable that contradicts the DeepSpeed config is an error, not a silent pick."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from phalanx import envvars
from phalanx.strategies import deepspeed_config
from phalanx.strategies.base import StrategyOptions
from phalanx.strategies.precision import check_name


@dataclass
class TrainingSettings:
    strategy: str
    options: StrategyOptions
    grad_accum_steps: int = 1
    gradient_clipping: float | None = None  # clip before every optimizer.step() (DeepSpeed's key)
    deepspeed: deepspeed_config.DeepSpeedSettings | None = None


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _regions(options: StrategyOptions, activation_checkpointing: Any, compile: Any) -> None:
    """activation_checkpointing / compile: argument > PHALANX_* variable > strategy_options."""
    from phalanx.strategies import activation_ckpt

    if activation_checkpointing is None and _env(envvars.PHALANX_ACTIVATION_CHECKPOINTING) is not None:
        activation_checkpointing = activation_ckpt.parse(_env(envvars.PHALANX_ACTIVATION_CHECKPOINTING))
    if activation_checkpointing is not None:
        options.activation_checkpointing = activation_checkpointing
    if compile is None and _env(envvars.PHALANX_COMPILE) is not None:
        raw = _env(envvars.PHALANX_COMPILE).strip().lower()
        if raw not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"{envvars.PHALANX_COMPILE}={raw!r} is not a boolean (use true/false)")
        compile = raw in ("1", "true", "yes", "on")
    if compile is not None:
        options.compile = compile


def resolve(strategy: str | None = None, mixed_precision: str | None = None, grad_accum_steps: int | None = None,
            deepspeed: str | os.PathLike | Mapping[str, Any] | None = None,
            strategy_options: Mapping[str, Any] | StrategyOptions | None = None,
            activation_checkpointing: Any = None, compile: Any = None) -> TrainingSettings:
    strategy = strategy if strategy is not None else _env(envvars.PHALANX_STRATEGY)
    mixed_precision = mixed_precision if mixed_precision is not None else _env(envvars.PHALANX_MIXED_PRECISION)
    if grad_accum_steps is None and _env(envvars.PHALANX_GRAD_ACCUM_STEPS) is not None:
        raw = _env(envvars.PHALANX_GRAD_ACCUM_STEPS)
        if not raw.isdigit():
            raise ValueError(f"{envvars.PHALANX_GRAD_ACCUM_STEPS}={raw!r} is not a positive integer")
        grad_accum_steps = int(raw)
    deepspeed = deepspeed if deepspeed is not None else _env(envvars.PHALANX_DEEPSPEED_CONFIG)
    if isinstance(strategy_options, StrategyOptions):
        options = strategy_options
    else:
        options = StrategyOptions.from_dict(dict(strategy_options or {}))

    ds = deepspeed_config.load(deepspeed) if deepspeed is not None else None
    clipping = None
    if ds is not None:
        src = ds.source
        if strategy is not None and strategy.strip().lower() == "fsdp":
            strategy = "zero3"
        strategy = deepspeed_config.merge("strategy", strategy, ds.strategy, src)
        mixed_precision = deepspeed_config.merge(
            "mixed_precision", check_name(mixed_precision) if mixed_precision is not None else None,
            ds.mixed_precision, src)
        grad_accum_steps = deepspeed_config.merge("grad_accum_steps", grad_accum_steps, ds.grad_accum_steps, src)
        if ds.cpu_offload and not options.cpu_offload:
            options.cpu_offload = True
        clipping = ds.gradient_clipping
    _regions(options, activation_checkpointing, compile)
    options.mixed_precision = check_name(mixed_precision or options.mixed_precision)
    return TrainingSettings(strategy=strategy or "auto", options=options,
                            grad_accum_steps=int(grad_accum_steps or 1), gradient_clipping=clipping,
                            deepspeed=ds)
