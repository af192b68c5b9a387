"""`phalanx run`'s flags: one per schema setting (`phalanx.config.SETTINGS`, both spellings), torchrun's
agent flags, then SCRIPT ARGS. Apart from run_command.py so the worker's hint for a launcher flag
written after the script (misplaced_flag.py) reads them without importing the launcher (no cycle)."""

from __future__ import annotations

import argparse

from phalanx import config
from phalanx.config.schema import LAUNCH, TORCHRUN
from phalanx.launch import flag_spelling, local_rank, torchrun_flags


def _flag_help(setting: config.Setting) -> str:
    where = f"; env {setting.env}" if setting.env else ""
    shown = str(setting.default).lower() if isinstance(setting.default, bool) else config.to_env_value(setting.default)
    default = "" if setting.default in (None, "") else f" (default {shown}{where})"
    text = setting.help + (default or (f" ({where[2:]})" if where else ""))
    return text.replace("%", "%%")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `phalanx run`'s flags: one per schema setting (both spellings), then SCRIPT ARGS..."""
    parser.allow_abbrev = False  # `--nproc 2` must not silently mean --nproc-per-node
    parser.usage = "%(prog)s [options] (SCRIPT | -m MODULE) [ARGS...]"
    parser.description = (
        "launch a training script on N processes / nodes. Most runs need a few of: --nproc-per-node, --nnodes, "
        "--strategy, --mixed-precision, --grad-accum-steps, --seed, --checkpoint-dir, --max-restarts, --trackers, "
        "--config. The flags come in groups: " + ", ".join(group.name for group in config.GROUPS) + "."
    )
    groups = {group: parser.add_argument_group(group.name, group.description) for group in config.GROUPS}
    for setting in config.SETTINGS:
        add = groups[setting.group].add_argument
        if setting.bool_flag:
            add(
                *setting.flags,
                dest=setting.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_flag_help(setting),
            )
        else:
            add(*setting.flags, dest=setting.name, default=None, metavar=setting.metavar, help=_flag_help(setting))
    launch = groups[LAUNCH]
    launch.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML file of launcher and runtime settings (`phalanx config` writes a template); "
        "flags and PHALANX_* variables override it",
    )
    launch.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    torchrun = groups[TORCHRUN]
    torchrun.add_argument(
        local_rank.FLAG_NAME,
        "--pass_local_rank",
        dest="pass_local_rank",
        nargs="?",
        const=local_rank.DEFAULT_SPELLING,
        default=None,
        metavar="FLAG",
        help="append FLAG=<local rank> to each worker's arguments, as torch.distributed.launch did "
        "(default --local-rank; --pass-local-rank=--local_rank for the old spelling)",
    )
    torchrun_flags.configure(torchrun)  # torchrun's agent flags (--tee, --log-dir, ...), checked against torch's parser
    add = parser.add_argument
    add("target", metavar="SCRIPT", help="training script (or module with -m)")
    add("target_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script untouched")
    _refuse_unknown_flags(parser)


def _refuse_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Report unknown flags before the script as `phalanx run` errors, not the top-level parser's."""
    parse_known = parser.parse_known_args

    def takes_value(option: str) -> bool:
        action = parser._option_string_actions.get(option)
        return action is not None and action.nargs != 0

    def strict_parse_known_args(args=None, namespace=None):  # type: ignore[no-untyped-def]
        if args is not None:
            args = local_rank.expand_bare_flag(list(args), takes_value)
        namespace, extras = parse_known(args, namespace)
        if extras:
            text, matched = flag_spelling.unrecognized(extras, parser._option_string_actions)
            parser.error(
                text
                if matched
                else f"{text}. phalanx run's own flags go before the script; everything after the "
                "script name is passed to the script. HINT: see phalanx run --help"
            )
        return namespace, extras

    parser.parse_known_args = strict_parse_known_args  # type: ignore[method-assign]
