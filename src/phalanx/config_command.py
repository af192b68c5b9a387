"""`phalanx config`: write the settings template (every setting of the schema at its default)."""

from __future__ import annotations

import argparse
import os
import sys

from phalanx import config

DEFAULT_PATH = "phalanx.yaml"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", nargs="?", default=DEFAULT_PATH, help=f"file to write (default {DEFAULT_PATH}; '-' prints to stdout)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def main(args: argparse.Namespace) -> int:
    text = config.template_text()
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
