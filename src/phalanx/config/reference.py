"""The settings reference (docs/settings.md), generated from the schema: one table per group.

    python -m phalanx.config.reference docs/settings.md    # regenerate (no path: print it)

tests/docs/test_settings_reference.py fails when the committed page differs from what this writes,
so a new schema row reaches the documentation without hand edits. Pure Python, no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from phalanx.config.schema import GROUPS, SETTINGS, TORCHRUN, Group, Scope, Setting
from phalanx.config.sources import to_env_value

COMMAND = "python -m phalanx.config.reference docs/settings.md"

INTRO = f"""# Settings reference

<!-- Generated from src/phalanx/config/schema.py by `{COMMAND}`; do not edit by hand. -->

Every setting is one row of `src/phalanx/config/schema.py`. Each has a YAML key and a `Phalanx()`
keyword argument (its name), a `phalanx run` flag in both spellings (`--grad-accum-steps` and
`--grad_accum_steps`) and, for runtime settings, a `PHALANX_*` variable that `phalanx run` exports to
every worker. Launcher settings are read by `phalanx run` and config files only. Precedence:
`Phalanx()` keyword > flag or `PHALANX_*` variable > config file > default (see
[Settings and config files](configuration.md)). Boolean settings take `--name` / `--no-name` on the
command line and true/false, 1/0, yes/no or on/off elsewhere.

The tables follow the groups of `phalanx run --help`.
"""


def _code(text: str) -> str:
    return f"`{text}`"


def _default(setting: Setting) -> str:
    if setting.default is None or setting.default == "":
        return "unset"
    if isinstance(setting.default, bool):
        return _code(str(setting.default).lower())
    return _code(to_env_value(setting.default))


def _values(setting: Setting) -> str:
    if setting.kind.choices is not None:
        return ", ".join(_code(c) for c in setting.kind.choices())
    return setting.kind.name


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(setting: Setting) -> str:
    flag = f"`{setting.flag}` / `--no-{setting.flag[2:]}`" if setting.bool_flag else _code(setting.flag)
    env = _code(setting.env) if setting.env else "(launcher)"
    cells = [_code(setting.name), flag, env, _default(setting), _values(setting), setting.help]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _table(group: Group) -> list[str]:
    rows = [s for s in SETTINGS if s.group == group]
    lines = [f"## {group.name.capitalize()}", "", group.description[0].upper() + group.description[1:] + ".", ""]
    if group == TORCHRUN:
        return lines + [
            "No schema rows: `phalanx run` also takes every flag of torchrun (`--tee`, `--log-dir`, "
            "`--standalone`, ...) with torchrun's meaning, read from `PET_<NAME>` variables too, and "
            "`--pass-local-rank` for scripts written for `torch.distributed.launch`: see "
            "[the launcher](launcher.md#every-torchrun-flag).",
            "",
        ]
    lines += ["| setting | flag | variable | default | values | meaning |", "|---|---|---|---|---|---|"]
    lines += [_row(s) for s in rows]
    scopes = {s.scope for s in rows}
    if scopes == {Scope.LAUNCHER}:
        lines += ["", "Launcher settings: `phalanx run` flags and config-file keys only."]
    return lines + [""]


def reference_text() -> str:
    """docs/settings.md as the schema says it should read."""
    lines = [INTRO]
    for group in GROUPS:
        lines += _table(group)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print(f"usage: {COMMAND.replace('docs/settings.md', '[OUT.md]')}", file=sys.stderr)
        return 2
    text = reference_text()
    if args:
        Path(args[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
