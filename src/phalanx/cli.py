"""The `phalanx` command: a thin dispatcher over one module per subcommand.

Each subcommand module exposes `configure(parser)` (adds its flags) and `main(args) -> int`.
Modules are imported only when their subcommand runs... except for building the parser, which
needs every module's flags; so subcommand modules must not import torch at module level
(the launcher's start-up time is a feature: see bench/startup.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from phalanx.launch import flag_spelling

# name -> (module, one-line help). Add a subcommand by adding a line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("phalanx.launch.run_command", "launch a training script on N processes / nodes"),
    "plan": ("phalanx.plan.command", "per-strategy memory per rank for a model, and what auto would pick"),
    "slurm": ("phalanx.cluster.slurm_command", "write or submit an sbatch script that runs a script under phalanx"),
    "doctor": ("phalanx.doctor.command", "check this machine and allocation before a launch"),
    "export": ("phalanx.checkpoint.export", "consolidate a sharded checkpoint into one safetensors file"),
    "inspect": ("phalanx.checkpoint.inspect_command", "print a checkpoint's manifest"),
    "config": ("phalanx.config_command", "write the settings template (phalanx.yaml): every setting at its default"),
    "plot": ("phalanx.logging.plot", "plot the metrics a run logged with px.log() to a PNG"),
    "top": ("phalanx.observe.top_command", "a live table of a running job's ranks: step, phase split, straggler"),
    "parity": (
        "phalanx.parity.command",
        "check that a script trains alike on 1 process and on N (loss, gradient norm)",
    ),
}


def version_text() -> str:
    """`phalanx --version`: phalanx's version and the installed torch's, read without importing torch."""
    from importlib import metadata

    from phalanx import __version__

    try:
        torch_version = f"torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        torch_version = "torch not installed"
    return f"phalanx {__version__} ({torch_version})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="Take a single-device PyTorch script to many processes, GPUs and machines.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(sub_parser)
        sub_parser.set_defaults(_handler=module.main, _parser=sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, extras = build_parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extras:  # said by the subcommand's parser, with what each flag likely meant
        args._parser.error(flag_spelling.unrecognized(extras, args._parser._option_string_actions)[0])
    return int(args._handler(args) or 0)
