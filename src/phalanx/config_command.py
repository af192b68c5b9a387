"""Config files on the command line: `phalanx config` (a commented starter file) and the glue that
lets `phalanx run --config FILE` merge a file under its flags.

`phalanx run` precedence: a setting given as a flag wins; else a PHALANX_* variable already in the
environment (runtime settings); else the file; else the launcher's default.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any, Mapping

from phalanx import config

DEFAULT_PATH = "phalanx.yaml"
_UNSET = argparse.SUPPRESS  # sentinel default: "flag not given" (argparse leaves it untouched)
_DEFAULTS_ATTR = "_phalanx_flag_defaults"
_EXAMPLES = {"nproc_per_node": "2", "nnodes": "1", "master_addr": "127.0.0.1", "master_port": "29500",
             "rdzv_backend": "c10d", "rdzv_endpoint": "node0:29400", "rdzv_id": "job1", "rdzv_timeout": "300",
             "deepspeed": "ds_config.json", "seed": "0", "strategy": "ddp", "mixed_precision": "no", "grad_accum_steps": "1",
             "memory_budget": "8GB", "checkpoint_dir": "ckpt", "watchdog_timeout": "600", "log_level": "INFO", "log_sinks": "[csv, jsonl]"}


# ---- `phalanx config` --------------------------------------------------------------------------
def starter_text() -> str:
    """A YAML file listing every setting, commented out, with its help, flag and variable."""
    lines = ["# phalanx config: `phalanx run --config THIS_FILE script.py` or `Phalanx.from_config(THIS_FILE)`.",
             "# Precedence: this file < PHALANX_* environment variables < command-line flags / keyword arguments.",
             "# Uncomment what you need; unknown keys are rejected.", ""]
    for scope, title in ((config.LAUNCHER, "launcher: processes and nodes (read by `phalanx run`)"),
                         (config.RUNTIME, "runtime: what each worker's Phalanx() does (exported as PHALANX_*)")):
        lines += [f"# --- {title} ---"]
        for s in (s for s in config.SETTINGS if s.scope == scope):
            where = ", ".join(x for x in (s.flag and f"flag {s.flag}", s.env and f"env {s.env}") if x)
            lines += [f"# {line}" for line in textwrap.wrap(f"{s.help} ({where})", 96)]
            lines += [f"# {s.name}: {_EXAMPLES.get(s.name, _example(s))}", ""]
    return "\n".join(lines)


def _example(setting: config.Setting) -> str:
    if setting.choices:
        return setting.choices[0]
    return {"int": "0", "positive_int": "1", "int_or_auto": "auto", "positive_float": "300", "non_negative_float": "60", "bool": "false",
            "str_list": "[auto]", "path": "path/to/dir", "bool_or_str_list": "false"}.get(setting.kind, "...")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH,
                        help=f"file to write (default {DEFAULT_PATH}; '-' prints to stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def main(args: argparse.Namespace) -> int:
    text = starter_text()
    if args.path == "-":
        sys.stdout.write(text)
        return 0
    if os.path.exists(args.path) and not args.force:
        print(f"phalanx config: error: {args.path} exists. HINT: pass --force to overwrite it.", file=sys.stderr)
        return 2
    with open(args.path, "w", encoding="utf-8") as fp:
        fp.write(text)
    print(f"wrote {args.path}: uncomment the settings you need, then `phalanx run --config {args.path} SCRIPT`")
    return 0


# ---- `phalanx run --config` --------------------------------------------------------------------
def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Setting name -> the launcher's argparse action for its flag (settings it has a flag for)."""
    by_option = {opt: action for action in parser._actions for opt in action.option_strings}
    return {s.name: by_option[s.flag] for s in config.SETTINGS if s.flag in by_option}


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """Add --config, and make the launcher's setting flags default to "not given" so a file can fill them."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML file of launcher and runtime settings (`phalanx config` writes a starter); "
                             "flags and PHALANX_* variables override it")
    actions = _flag_actions(parser)
    parser.set_defaults(**{_DEFAULTS_ATTR: {a.dest: (name, a.default, a.type) for name, a in actions.items()}})
    for action in actions.values():
        action.default = _UNSET


def apply_config_file(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Fill the flags not given from the file, unless a PHALANX_* variable sets them; else defaults.

    Returns the PHALANX_* variables to export for runtime settings the launcher has no flag for.
    Idempotent. Raises `config.ConfigError` for a bad file or value.
    """
    env = os.environ if env is None else env
    path = getattr(args, "config", None)
    file_values = config.load(path) if path else {}
    flags: dict[str, tuple[str, Any, Any]] = getattr(args, _DEFAULTS_ATTR, {})
    for dest, (name, default, parse) in flags.items():
        if hasattr(args, dest):
            continue  # given on the command line: the flag wins
        setting = config.BY_NAME[name]
        if name not in file_values or (setting.env and env.get(setting.env)):
            setattr(args, dest, default)  # the env (inherited by the workers) or the launcher's default
            continue
        text = config.to_env_value(file_values[name])
        try:
            setattr(args, dest, parse(text) if parse else text)
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise config.ConfigError(f"{path}: {name}: {error}") from None
    flagged = {name for name, _, _ in flags.values()}
    return {
        config.BY_NAME[name].env: config.to_env_value(value)
        for name, value in file_values.items()
        if name not in flagged and config.BY_NAME[name].scope == config.RUNTIME
        and config.BY_NAME[name].env and not env.get(config.BY_NAME[name].env)
    }
