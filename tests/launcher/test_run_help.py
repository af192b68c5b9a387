"""`phalanx run --help` in groups (launch, layout and strategy, training loop, checkpoints, logging,
torchrun compatibility): every schema row in exactly one, the one written above it in the schema;
every torchrun flag under torchrun compatibility. `phalanx --version` names phalanx and torch."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from phalanx import __version__, cli, config
from phalanx.launch import torchrun_flags


def run_parser():
    parser = cli.build_parser()
    return parser._subparsers._group_actions[0].choices["run"]  # noqa: SLF001 - argparse keeps them here


def groups_by_dest() -> dict[str, list[str]]:
    """dest -> titles of the help sections that list it."""
    found: dict[str, list[str]] = {}
    for group in run_parser()._action_groups:  # noqa: SLF001
        for action in group._group_actions:  # noqa: SLF001
            found.setdefault(action.dest, []).append(group.title)
    return found


def test_every_schema_row_is_in_exactly_one_group_the_one_above_it():
    names = [group.name for group in config.GROUPS]
    assert names == [
        "launch",
        "layout and strategy",
        "training loop",
        "checkpoints",
        "logging",
        "torchrun compatibility",
    ]
    found = groups_by_dest()
    for setting in config.SETTINGS:
        assert setting.group in config.GROUPS, setting.name
        assert found[setting.name] == [setting.group.name], setting.name


def test_torchrun_flags_sit_under_torchrun_compatibility():
    found = groups_by_dest()
    for flag in torchrun_flags.FLAGS:
        if not flag.defined_by_run_command:
            assert found[flag.dest] == ["torchrun compatibility"], flag.dest
    assert found["pass_local_rank"] == ["torchrun compatibility"]
    assert found["config"] == ["launch"] and found["module"] == ["launch"]


def test_help_shows_the_groups_in_order_and_names_flags_that_exist():
    text = run_parser().format_help()
    positions = [text.index(f"\n{group.name}:\n  {group.description.split()[0]}") for group in config.GROUPS]
    assert positions == sorted(positions)
    intro = text[: positions[0]]
    named = [word.strip(",.") for word in intro.split() if word.startswith("--")]
    assert len(named) >= 8
    options = {option for action in run_parser()._actions for option in action.option_strings}  # noqa: SLF001
    assert set(named) <= options, set(named) - options


def test_version_prints_phalanx_and_torch():
    result = subprocess.run([sys.executable, "-m", "phalanx", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"phalanx {__version__} (torch {metadata.version('torch')})\n"
