"""Settings: one schema (`schema.SETTINGS`), its value kinds, its sources and their precedence.

    from phalanx import config
    resolved = config.resolve(config.from_yaml("phalanx.yaml"), config.from_env(env))
    resolved.config.strategy      # typed, checked, defaulted

Pure Python (no torch): `phalanx run` checks every setting here before any worker starts.
"""

from __future__ import annotations

import inspect
from typing import Any

from phalanx.config.schema import (
    BY_NAME,
    GROUPS,
    LAUNCHER,
    RUNTIME,
    SETTINGS,
    Group,
    PhalanxConfig,
    Scope,
    Setting,
    valid_keys,
)
from phalanx.config.sources import (
    ConfigError,
    Layer,
    Resolved,
    from_env,
    from_flags,
    from_kwargs,
    from_mapping,
    from_yaml,
    from_yaml_runtime,
    override_lines,
    resolve,
    to_env_value,
    worker_env,
)
from phalanx.config.template import template_text

__all__ = [
    "BY_NAME",
    "GROUPS",
    "Group",
    "LAUNCHER",
    "RUNTIME",
    "SETTINGS",
    "ConfigError",
    "Layer",
    "PhalanxConfig",
    "Resolved",
    "Scope",
    "Setting",
    "from_env",
    "from_flags",
    "from_kwargs",
    "from_mapping",
    "from_yaml",
    "from_yaml_runtime",
    "keyword_parameters",
    "override_lines",
    "resolve",
    "template_text",
    "to_env_value",
    "valid_keys",
    "with_settings",
    "worker_env",
]


def with_settings(signature: inspect.Signature) -> inspect.Signature:
    """`signature` (of a function taking **settings) with every runtime setting as a keyword argument."""
    fixed = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    named = {p.name for p in fixed}
    return inspect.Signature([*fixed, *(p for p in keyword_parameters() if p.name not in named)])


def keyword_parameters() -> list[inspect.Parameter]:
    """`Phalanx()`'s setting arguments, keyword-only, None meaning "from the env, file or default"."""
    return [inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any) for s in RUNTIME]
