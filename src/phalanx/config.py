"""Config files: one schema for the launcher and the runtime, and the precedence file < env < flag.

A YAML file names launcher settings (processes, nodes, ...) and runtime settings (strategy, mixed
precision, accumulation, checkpoint dir, watchdog, ...). The launcher (`phalanx run --config`)
turns runtime settings into the PHALANX_* variables of `phalanx.envvars`, which every worker's
`Phalanx()` reads; `Phalanx.from_config(path)` does the same inside one process.

Pure Python, no torch: the launcher imports it.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from phalanx import envvars


class ConfigError(ValueError):
    """A bad config file or value; the message names the key, the value and the fix."""


LAUNCHER = "launcher"
RUNTIME = "runtime"


def _meta(scope: str, help: str, *, env: str | None = None, flag: str | None = None,
          kind: str = "str", choices: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"scope": scope, "help": help, "env": env, "flag": flag, "kind": kind, "choices": choices}


@dataclass
class PhalanxConfig:
    """Every setting a config file may hold. None means "not set here: use the next layer down".

    Launcher settings are read by `phalanx run` only (file < flag). Runtime settings travel to the
    workers as PHALANX_* variables (file < env < flag); the ones no phalanx module reads yet still
    pass through, for the strategies and tools that read them.
    """

    # --- launcher: how many processes, where ---
    nproc_per_node: int | str | None = field(default=None, metadata=_meta(
        LAUNCHER, "workers per node: a number, or auto (one per GPU, else 2 on CPU)",
        flag="--nproc-per-node", kind="int_or_auto"))
    nnodes: int | str | None = field(default=None, metadata=_meta(
        LAUNCHER, "number of nodes, or MIN:MAX for an elastic range (c10d)", flag="--nnodes"))
    node_rank: int | None = field(default=None, metadata=_meta(
        LAUNCHER, "rank of this node (usually given per node on the command line)", flag="--node-rank", kind="int"))
    master_addr: str | None = field(default=None, metadata=_meta(LAUNCHER, "address of node 0", flag="--master-addr"))
    master_port: int | None = field(default=None, metadata=_meta(
        LAUNCHER, "port of node 0's store", flag="--master-port", kind="int"))
    rdzv_backend: str | None = field(default=None, metadata=_meta(
        LAUNCHER, "rendezvous backend: static, c10d, etcd...", flag="--rdzv-backend"))
    rdzv_endpoint: str | None = field(default=None, metadata=_meta(
        LAUNCHER, "rendezvous endpoint HOST:PORT", flag="--rdzv-endpoint"))
    rdzv_id: str | None = field(default=None, metadata=_meta(LAUNCHER, "job id shared by all nodes", flag="--rdzv-id"))
    rdzv_timeout: float | None = field(default=None, metadata=_meta(
        LAUNCHER, "seconds for all nodes to meet before failing with a report", flag="--rdzv-timeout",
        kind="positive_float"))
    max_restarts: int | None = field(default=None, metadata=_meta(
        LAUNCHER, "restarts of the worker group after a failure", flag="--max-restarts", kind="int"))
    start_method: str | None = field(default=None, metadata=_meta(
        LAUNCHER, "how workers start: auto, fork or spawn", flag="--start-method", kind="choice",
        choices=("auto", "fork", "spawn")))
    # --- runtime: what each worker's Phalanx() does ---
    strategy: str | None = field(default=None, metadata=_meta(
        RUNTIME, "auto, single, dp, ddp, zero1, zero2, zero3 (fsdp), hsdp", env=envvars.PHALANX_STRATEGY, flag="--strategy"))
    mixed_precision: str | None = field(default=None, metadata=_meta(
        RUNTIME, "no, bf16 or fp16", env=envvars.PHALANX_MIXED_PRECISION, flag="--mixed-precision"))
    grad_accum_steps: int | None = field(default=None, metadata=_meta(
        RUNTIME, "micro-batches per optimizer step", env=envvars.PHALANX_GRAD_ACCUM_STEPS,
        flag="--grad-accum-steps", kind="positive_int"))
    memory_budget: str | None = field(default=None, metadata=_meta(
        RUNTIME, "per-device memory budget for strategy auto, e.g. 8GB", env=envvars.PHALANX_MEMORY_BUDGET,
        flag="--memory-budget"))
    checkpoint_dir: str | None = field(default=None, metadata=_meta(
        RUNTIME, "where checkpoints are written and resumed from", env=envvars.PHALANX_CHECKPOINT_DIR,
        flag="--checkpoint-dir", kind="path"))
    watchdog_timeout: float | None = field(default=None, metadata=_meta(
        RUNTIME, "seconds without progress before a hang is reported; 0 turns the watchdog off",
        env=envvars.PHALANX_WATCHDOG_TIMEOUT, flag="--watchdog-timeout", kind="non_negative_float"))
    collective_timeout: float | None = field(default=None, metadata=_meta(
        RUNTIME, "seconds a collective may wait before failing", env=envvars.PHALANX_COLLECTIVE_TIMEOUT,
        flag="--collective-timeout", kind="positive_float"))
    deepspeed: str | None = field(default=None, metadata=_meta(
        RUNTIME, "path of a DeepSpeed JSON config", env=envvars.PHALANX_DEEPSPEED_CONFIG, flag="--deepspeed", kind="path"))
    seed: int | None = field(default=None, metadata=_meta(
        RUNTIME, "seed for data order and the script's RNGs", env=envvars.PHALANX_SEED, flag="--seed", kind="int"))
    debug: bool | None = field(default=None, metadata=_meta(
        RUNTIME, "check collectives for mismatches (slower)", env=envvars.PHALANX_DEBUG, flag="--debug", kind="bool"))
    # --- runtime: logging and metrics ---
    run_dir: str | None = field(default=None, metadata=_meta(
        RUNTIME, "directory for metrics and per-rank logs (default runs/<time>)", env=envvars.PHALANX_RUN_DIR,
        flag="--run-dir", kind="path"))
    log_level: str | None = field(default=None, metadata=_meta(
        RUNTIME, "level of phalanx's own messages", env=envvars.PHALANX_LOG_LEVEL, flag="--log-level",
        kind="choice", choices=("DEBUG", "INFO", "WARNING", "ERROR")))
    log_all_ranks: bool | None = field(default=None, metadata=_meta(
        RUNTIME, "print phalanx's messages from every rank, not only rank 0", env=envvars.PHALANX_LOG_ALL_RANKS,
        flag="--log-all-ranks", kind="bool"))
    log_sinks: list[str] | None = field(default=None, metadata=_meta(
        RUNTIME, "where px.log() writes: auto (csv, jsonl, tensorboard if installed) or a list of csv, jsonl, tensorboard",
        env=envvars.PHALANX_LOG_SINKS, flag="--log-sinks", kind="str_list"))
    progress: str | None = field(default=None, metadata=_meta(
        RUNTIME, "progress bar: auto (when stdout is a terminal), on or off", env=envvars.PHALANX_PROGRESS,
        flag="--progress", kind="choice", choices=("auto", "on", "off")))


@dataclass(frozen=True)
class Setting:
    """One row of the schema: a field of PhalanxConfig with its env variable and flag."""

    name: str
    scope: str
    help: str
    env: str | None
    flag: str | None
    kind: str
    choices: tuple[str, ...]


SETTINGS: tuple[Setting, ...] = tuple(
    Setting(f.name, **f.metadata) for f in dataclasses.fields(PhalanxConfig)
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def valid_keys() -> list[str]:
    return [s.name for s in SETTINGS]


# ---- values ------------------------------------------------------------------------------------
def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false)")


_YAML_BOOL_WORDS = {"mixed_precision": {False: "no", True: "yes"}, "progress": {False: "off", True: "on"}}


def _number(value: Any, kind: type, what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str) if kind is float else (int, str)):
        raise ValueError(what)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(what) from None


def coerce(setting: Setting, value: Any) -> Any:
    """Check and convert a value from a file (typed) or an env var / flag (string)."""
    kind, text = setting.kind, value if isinstance(value, str) else None
    if isinstance(value, bool) and setting.name in _YAML_BOOL_WORDS:
        value = _YAML_BOOL_WORDS[setting.name][value]  # YAML 1.1 reads no/off/on as booleans
    try:
        if value is None:
            return None
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if text is not None:
                return _bool(text)
        elif kind in ("int", "positive_int"):
            number = _number(value, int, "not an integer")
            if kind == "positive_int" and number < 1:
                raise ValueError("must be at least 1")
            return number
        elif kind == "int_or_auto":
            if value == "auto":
                return "auto"
            number = _number(value, int, "must be a positive integer or 'auto'")
            if number < 1:
                raise ValueError("must be a positive integer or 'auto'")
            return number
        elif kind in ("positive_float", "non_negative_float"):
            number = _number(value, float, "must be a positive number")
            if number < 0 or (number == 0 and kind == "positive_float"):
                raise ValueError("must be a positive number" if kind == "positive_float" else "must be >= 0 (0 = off)")
            return number
        elif kind == "str_list":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError("must be a list of names")
            return [i.strip() for i in items if i.strip()]
        elif kind == "choice":
            if isinstance(value, str):
                wanted = value.upper() if setting.name == "log_level" else value
                if wanted in setting.choices:
                    return wanted
            raise ValueError(f"must be one of {', '.join(setting.choices)}")
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):  # str, path
            return str(value)
    except ValueError as error:
        raise ConfigError(f"{setting.name}: invalid value {value!r}: {error}") from None
    raise ConfigError(f"{setting.name}: invalid value {value!r} (expected {kind.replace('_', ' ')})")


def to_env_value(value: Any) -> str:
    """The string form a PHALANX_* variable carries."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


# ---- files -------------------------------------------------------------------------------------
def parse(data: Any, source: str = "config") -> dict[str, Any]:
    """Validate a mapping read from a file: known keys only, each value checked. Returns set keys."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}")
    unknown = [k for k in data if k not in BY_NAME]
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(map(repr, unknown))}. Valid keys: {', '.join(valid_keys())}. "
            "HINT: `phalanx config` writes a starter file listing them all."
        )
    values = {}
    for key, value in data.items():
        try:
            values[key] = coerce(BY_NAME[key], value)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
        if BY_NAME[key].kind == "path" and values[key] is not None and not os.path.isabs(values[key]):
            # Relative paths mean relative to the file, so a run works from any directory.
            base = os.path.dirname(os.path.abspath(source)) if os.path.exists(source) else os.getcwd()
            values[key] = os.path.normpath(os.path.join(base, values[key]))
    return {k: v for k, v in values.items() if v is not None}


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
        int_tag, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"))
    return Loader


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a YAML config file; returns only the keys it sets."""
    import yaml

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fp:
            data = yaml.load(fp, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found. HINT: `phalanx config {path}` writes a starter file.") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from None
    return parse(data, path)


# ---- precedence --------------------------------------------------------------------------------
def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Runtime settings present in the environment (PHALANX_* variables), checked."""
    values = {}
    for s in SETTINGS:
        if s.env and env.get(s.env, "") != "":
            try:
                values[s.name] = coerce(s, env[s.env])
            except ConfigError as error:
                raise ConfigError(f"environment variable {s.env}: {error}") from None
    return values


def resolve(file_values: Mapping[str, Any], env: Mapping[str, str], flags: Mapping[str, Any]) -> PhalanxConfig:
    """Merge the three layers, later winning: file < env < flag. Flags set to None are "not given"."""
    merged: dict[str, Any] = dict(file_values)
    merged.update(from_env(env))
    for name, value in flags.items():
        if name not in BY_NAME:
            raise ConfigError(f"unknown setting {name!r}. Valid settings: {', '.join(valid_keys())}")
        if value is not None:
            merged[name] = coerce(BY_NAME[name], value)
    return PhalanxConfig(**merged)


def runtime_env(config: PhalanxConfig) -> dict[str, str]:
    """The PHALANX_* variables that carry a config's runtime settings to the workers."""
    return {
        s.env: to_env_value(getattr(config, s.name))
        for s in SETTINGS
        if s.scope == RUNTIME and s.env and getattr(config, s.name) is not None
    }


def runtime_kwargs(path: str | os.PathLike[str] | None, env: Mapping[str, str], overrides: Mapping[str, Any],
                   accepted: Iterable[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """For `Phalanx.from_config`: (keyword arguments for `Phalanx()`, variables to export).

    Settings `Phalanx()` accepts as arguments go there; the others are exported as their PHALANX_*
    variables, which the modules that implement them read. Overrides that are not settings
    (e.g. `cpu=True`) are passed through as arguments.
    """
    file_values = load(path) if path is not None else {}
    launcher_keys = [k for k in file_values if BY_NAME[k].scope == LAUNCHER]
    for key in launcher_keys:  # harmless inside a worker: the launcher already used them
        del file_values[key]
    settings = {k: v for k, v in overrides.items() if k in BY_NAME}
    config = resolve(file_values, env, settings)
    accepted = set(accepted)
    kwargs = {k: v for k, v in overrides.items() if k not in BY_NAME}
    exported: dict[str, str] = {}
    for s in SETTINGS:
        value = getattr(config, s.name)
        if s.scope != RUNTIME or value is None:
            continue
        if s.name in accepted:
            kwargs[s.name] = value
        elif s.env:
            exported[s.env] = to_env_value(value)
    return kwargs, exported

