"""One place that turns Phalanx() arguments, PHALANX_* variables and a DeepSpeed config into the
settings a strategy is built from. Precedence: argument > environment variable > DeepSpeed config >
default; an argument/variable that contradicts the DeepSpeed config is an error, not a silent pick."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from phalanx import config, envvars
from phalanx.strategies import deepspeed_config
from phalanx.strategies.base import StrategyOptions
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
            grad_accum_remainder: str | None = None) -> TrainingSettings:
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
    remainder = grad_accum_remainder if grad_accum_remainder is not None else _env(envvars.PHALANX_GRAD_ACCUM_REMAINDER)
    remainder = _choice("grad_accum_remainder", remainder)
    return TrainingSettings(strategy=strategy or "auto", options=options,
                            grad_accum_steps=int(grad_accum_steps or 1), gradient_clipping=clipping,
                            deepspeed=ds, grad_accum_remainder=remainder)


def _choice(name: str, value: Any) -> Any:
    """`value` checked against the setting's choices; its default when None."""
    setting = config.BY_NAME[name]
    if value is None:
        return setting.default
    if value not in setting.choices:
        source = f" (from {setting.env})" if _env(setting.env or "") == value else ""
        raise ValueError(f"{name}={value!r}{source} is not one of {', '.join(setting.choices)}. "
                         f"HINT: Phalanx({name}={setting.choices[0]!r}) or {setting.flag} {setting.choices[0]}")
    return value


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
