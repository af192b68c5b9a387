"""One place that turns Phalanx() arguments, PHALANX_* variables and a DeepSpeed config into the
settings a strategy is built from. Precedence: argument > environment variable > DeepSpeed config >
default; an argument/variable that contradicts the DeepSpeed config is an error, not a silent pick."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from phalanx import config, envvars
from phalanx.strategies import ddp_rules, deepspeed_config
from phalanx.strategies.base import StrategyOptions
from phalanx.strategies.ddp_options import DDPOptions
from phalanx.runtime import seeding
from phalanx.strategies.precision import check_name


@dataclass
class TrainingSettings:
    strategy: str
    options: StrategyOptions
    grad_accum_steps: int = 1
    grad_accum_remainder: str = "flush"  # an epoch's last, incomplete cycle: flush (step) or drop
    gradient_clipping: float | None = None  # clip before every optimizer.step() (DeepSpeed's key)
    deepspeed: deepspeed_config.DeepSpeedSettings | None = None


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def resolve(strategy: str | None = None, mixed_precision: str | None = None, grad_accum_steps: int | None = None,
            deepspeed: str | os.PathLike | Mapping[str, Any] | None = None,
            strategy_options: Mapping[str, Any] | StrategyOptions | None = None, *,
            grad_accum_remainder: str | None = None, ddp: Mapping[str, Any] | None = None) -> TrainingSettings:
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
    options.mixed_precision = check_name(mixed_precision or options.mixed_precision)
    options.ddp = resolve_ddp(strategy or "auto", ddp or {})
    remainder = _with_default("grad_accum_remainder", grad_accum_remainder)
    return TrainingSettings(strategy=strategy or "auto", options=options,
                            grad_accum_steps=int(grad_accum_steps or 1), gradient_clipping=clipping,
                            deepspeed=ds, grad_accum_remainder=remainder)


def setting_value(name: str, value: Any) -> Any:
    """A runtime setting's value: the argument, else its PHALANX_* variable, else None; checked
    against the setting's row in `phalanx.config` (kind, choices)."""
    row = config.BY_NAME[name]
    if value is not None:
        return config.coerce(row, value)
    raw = _env(row.env) if row.env else None
    if raw is None:
        return None
    try:
        return config.coerce(row, raw)
    except config.ConfigError as error:
        raise config.ConfigError(f"environment variable {row.env}: {error}") from None


def _with_default(name: str, value: Any) -> Any:
    value = setting_value(name, value)
    return config.BY_NAME[name].default if value is None else value


def resolve_ddp(strategy: str, given: Mapping[str, Any]) -> DDPOptions:
    """DDP options from arguments (None: not given) and PHALANX_* variables; refused under a
    strategy without DDP, before any process group is joined."""
    values = {name: setting_value(name, given.get(name)) for name in ddp_rules.DDP_SETTINGS}
    values = {k: v for k, v in values.items() if v is not None}
    ddp_rules.refuse_without_ddp(strategy, values)
    return DDPOptions(**values, given=tuple(values))


def resolve_seed(seed: int | None) -> tuple[int, bool]:
    """(the run's seed, whether it was given): argument > PHALANX_SEED > the last seed_everything()
    seed > the `seed` row's default. Only a given seed re-seeds the global RNGs; the default still
    fixes data order, and a seed_everything() seed has seeded them already."""
    if seed is not None:
        return seeding.check_seed(seed), True
    raw = _env(envvars.PHALANX_SEED)
    if raw is not None:
        try:
            return int(raw), True
        except ValueError:
            raise ValueError(f"{envvars.PHALANX_SEED}={raw!r} is not an integer. HINT: phalanx run --seed 42") from None
    if seeding.last_seed() is not None:
        return seeding.last_seed(), False  # type: ignore[return-value]
    return int(config.BY_NAME["seed"].default), False
