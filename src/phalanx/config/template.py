"""`phalanx config`'s template: every setting of the schema, commented out at its default value,
with its help, flag and variable. Uncommenting any line as written is accepted by `phalanx run`."""

from __future__ import annotations

import textwrap

from phalanx.config.schema import SETTINGS, Scope, Setting


def _yaml_value(setting: Setting) -> str:
    import yaml

    text = yaml.safe_dump(setting.default, default_flow_style=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def template_text() -> str:
    lines = [
        "# phalanx config: `phalanx run --config THIS_FILE script.py` or `Phalanx.from_config(THIS_FILE)`.",
        "# Precedence: this file < PHALANX_* variables and flags < Phalanx() keyword arguments.",
        "# Every line shows the default; uncomment and change what you need. Unknown keys are rejected.",
        "",
    ]
    for scope, title in (
        (Scope.LAUNCHER, "launcher: processes and nodes (read by `phalanx run`)"),
        (Scope.RUNTIME, "runtime: what each worker's Phalanx() does (exported as PHALANX_*)"),
    ):
        lines.append(f"# --- {title} ---")
        for s in (s for s in SETTINGS if s.scope == scope):
            where = f"flag {s.flag}" + (f", env {s.env}" if s.env else "")
            lines += [f"# {line}" for line in textwrap.wrap(f"{s.help} ({where})", 96, break_on_hyphens=False)]
            lines += [f"# {s.name}: {_yaml_value(s)}", ""]
    return "\n".join(lines)
