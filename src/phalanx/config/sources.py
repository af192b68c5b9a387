"""Where settings come from (keyword arguments, flags, PHALANX_* variables, YAML files, a DeepSpeed
JSON) and how they are merged: kwarg > flag/env > YAML > default, resolved once, checked at once.

Every error is a ConfigError that names the source, the bad value and the valid ones, e.g.
`--strategy zero4: choose one of dp, ddp, zero1, zero2, zero3, fsdp, auto, single`.
Pure Python, no torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from phalanx.config import deepspeed as deepspeed_config, kinds
from phalanx.config.schema import BY_NAME, RUNTIME, SETTINGS, PhalanxConfig, Scope, Setting


class ConfigError(ValueError):
    """A bad setting; the message names the source, the value and the fix."""


# name -> (typed value, where it came from)
Layer = dict[str, tuple[Any, str]]


def _checked(setting: Setting, value: Any, label: str, *, text: bool, base_dir: str | None = None) -> Any:
    if value is None:
        return None
    try:
        parsed = setting.kind.from_text(value) if text else setting.kind.from_object(value)
    except ValueError as error:
        raise ConfigError(f"{label}: {error}") from None
    if (
        setting.kind.name == "path"
        or (setting.kind.name == "location" and not kinds.is_url(parsed))
        or (setting.name == "deepspeed" and isinstance(parsed, str))
    ):
        parsed = os.path.normpath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(parsed)))
        if setting.name == "deepspeed" and not os.path.isfile(parsed):
            raise ConfigError(f"{label}: file not found ({parsed}). HINT: pass the path of a DeepSpeed JSON config.")
    return parsed


def from_kwargs(kwargs: Mapping[str, Any]) -> Layer:
    """`Phalanx(name=value)`; None means "not given"."""
    layer: Layer = {}
    for name, value in kwargs.items():
        setting = BY_NAME.get(name)
        if setting is None or setting.scope != Scope.RUNTIME:
            valid = ", ".join(s.name for s in RUNTIME)
            raise TypeError(f"Phalanx() got an unexpected keyword argument {name!r}. Valid settings: {valid}")
        if value is not None:
            layer[name] = (_checked(setting, value, f"Phalanx({name}={value!r})", text=False), "Phalanx()")
    return layer


def from_flags(given: Mapping[str, Any]) -> Layer:
    """Flags `phalanx run` was given: name -> the raw string (or bool for --x/--no-x flags)."""
    layer: Layer = {}
    for name, raw in given.items():
        if raw is None:
            continue
        setting = BY_NAME[name]
        if isinstance(raw, bool):
            layer[name] = (raw, setting.flag if raw else "--no-" + setting.flag[2:])
        else:
            layer[name] = (_checked(setting, raw, f"{setting.flag} {raw}", text=True), setting.flag)
    return layer


def from_env(env: Mapping[str, str]) -> Layer:
    """Settings present as PHALANX_* variables (empty means unset): every runtime setting, and the
    launcher settings whose row names a variable."""
    layer: Layer = {}
    for setting in SETTINGS:
        if not setting.env:
            continue
        raw = env.get(setting.env, "")
        if raw != "":
            layer[setting.name] = (_checked(setting, raw, f"{setting.env}={raw}", text=True), setting.env or "")
    return layer


def _yaml_bool_as_word(setting: Setting, value: Any) -> Any:
    """YAML 1.1 reads `no`/`off`/`on` as booleans: give a choice setting back the word it meant."""
    if not isinstance(value, bool) or setting.kind.name != "choice":
        return value
    for word in ("yes", "on", "true") if value else ("no", "off", "false"):
        try:
            return setting.kind.from_text(word)
        except ValueError:
            continue
    return value


def from_mapping(data: Any, source: str, base_dir: str | None = None) -> Layer:
    """A mapping read from a config file: known keys only, each value checked."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}")
    unknown = [k for k in data if k not in BY_NAME]
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(map(repr, unknown))}. Valid keys: "
            f"{', '.join(s.name for s in SETTINGS)}. HINT: `phalanx config` writes a template listing them all."
        )
    layer: Layer = {}
    for key, value in data.items():
        setting = BY_NAME[key]
        value = _yaml_bool_as_word(setting, value)
        parsed = _checked(setting, value, f"{source}: {key}: {value}", text=False, base_dir=base_dir)
        if parsed is not None:
            layer[key] = (parsed, source)
    return layer


def _yaml_loader() -> Any:
    """PyYAML's SafeLoader minus YAML 1.1's base-60 integers, which read `nnodes: 1:2` as 62."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    int_tag = "tag:yaml.org,2002:int"
    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != int_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        int_tag,
        re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"),
    )
    return Loader


def from_yaml(path: str | os.PathLike[str]) -> Layer:
    """Read and check a YAML config file; relative paths in it are relative to the file."""
    import yaml

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fp:
            data = yaml.load(fp, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found. HINT: `phalanx config {path}` writes a template.") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from None
    return from_mapping(data, path, base_dir=os.path.dirname(os.path.abspath(path)))


def from_yaml_runtime(path: str | os.PathLike[str]) -> Layer:
    """A config file read inside a worker: launcher keys were the launcher's business; drop them."""
    return {k: v for k, v in from_yaml(path).items() if BY_NAME[k].scope == Scope.RUNTIME}


@dataclass(frozen=True)
class Resolved:
    """The merged settings, where each came from, and the DeepSpeed config they were checked against."""

    config: Any  # PhalanxConfig
    origin: dict[str, str] = field(default_factory=dict)  # name -> source, for settings not left at default
    deepspeed: Any = None  # phalanx.config.deepspeed.DeepSpeedConfig
    overridden: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    """name -> the values a later source replaced with a different one, and where each came from."""

    def is_set(self, name: str) -> bool:
        return name in self.origin


_DEEPSPEED_KEYS = ("strategy", "mixed_precision", "grad_accum_steps")


def resolve(*layers: Layer, warn: bool = True) -> Resolved:
    """Merge layers given lowest first over the defaults, then apply a DeepSpeed config if one is set.

    A DeepSpeed value fills a setting nobody set; one that contradicts an explicit value is an error.
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    overridden: dict[str, list[tuple[Any, str]]] = {}
    for layer in layers:
        for name, (value, where) in layer.items():
            if name in values and values[name] != value:
                overridden.setdefault(name, []).append((values[name], origin[name]))
            values[name], origin[name] = value, where
    ds = None
    if values.get("deepspeed") is not None:
        try:
            ds = deepspeed_config.load(values["deepspeed"], warn=warn)
        except ValueError as error:
            raise ConfigError(f"{origin['deepspeed']}: {error}") from None
        for name in _DEEPSPEED_KEYS:
            theirs = getattr(ds, name)
            if theirs is None:
                continue
            mine = values.get(name)
            if mine is not None and mine != theirs:
                raise ConfigError(
                    f"{name}={mine!r} was given by {origin[name]} but the {ds.source} says "
                    f"{theirs!r}. HINT: drop one of them."
                )
            values[name], origin[name] = theirs, ds.source
    return Resolved(PhalanxConfig(**values), origin, ds, overridden)


PRECEDENCE = "a Phalanx() keyword beats phalanx run's flags and PHALANX_* variables, a flag beats a variable, both beat a config file"


def _given(name: str, value: Any, source: str, launcher: bool) -> str:
    """How the user wrote `value` in `source`: Phalanx(strategy='ddp'), --strategy zero3, PHALANX_SEED=1."""
    setting = BY_NAME[name]
    if source == "Phalanx()":
        return f"Phalanx({name}={value!r})"
    if source == setting.env and launcher:  # under `phalanx run`, the launcher's value came as the variable
        return f"phalanx run's {setting.flag} {to_env_value(value)}"
    if source == setting.env:
        return f"{source}={to_env_value(value)}"
    if source.startswith("--"):
        return f"{source} {to_env_value(value)}"
    return f"{name}: {to_env_value(value)} in {source}"


def override_lines(resolved: Resolved, launcher: bool = False) -> list[str]:
    """One line per setting that two sources gave differently: which won, which lost, and how to
    change it (`launcher`: in a worker of `phalanx run`, whose PHALANX_* variables are its flags)."""
    lines = []
    for name, lost in resolved.overridden.items():
        where = resolved.origin[name]
        won = _given(name, getattr(resolved.config, name), where, launcher)
        losers = " and ".join(_given(name, value, source, launcher) for value, source in lost)
        if where == "Phalanx()":
            taken = _given(name, *lost[-1], launcher)
            fix = f"drop {name}= from Phalanx(...) to take {taken}, or stop giving it there"
        else:
            fix = f"give {name} in one place: drop {losers}, or change {won}"
        lines.append(f"{won} overrides {losers} ({PRECEDENCE}). HINT: {fix}")
    return lines


def to_env_value(value: Any) -> str:
    """The string form a PHALANX_* variable carries."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, Mapping):
        return json.dumps(dict(value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 30, not 30.0: what a user would have typed
    return str(value)


def _travels(setting: Setting, value: Any) -> bool:
    """Whether `value` survives the trip through its variable (a tp_plan mapping does; a dict of
    torch.compile options, which only Phalanx() takes, does not)."""
    if not isinstance(value, Mapping):
        return True
    try:
        return setting.kind.from_text(to_env_value(value)) == value
    except ValueError:
        return False


def worker_env(resolved: Resolved) -> dict[str, str]:
    """The PHALANX_* variables that carry the runtime settings somebody set to every worker."""
    env = {}
    for setting in RUNTIME:
        value = getattr(resolved.config, setting.name)
        if setting.env and resolved.is_set(setting.name) and value is not None and _travels(setting, value):
            env[setting.env] = to_env_value(value)
    return env
