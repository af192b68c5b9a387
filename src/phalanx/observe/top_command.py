"""`phalanx top [RUN_DIR]`: a live table of a running job, from another terminal (no torch)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from phalanx.logging.printable import printable
from phalanx.logging.run_dir import DEFAULT_ROOT
from phalanx.observe import records, table

REFRESH_S = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        nargs="?",
        default=None,
        metavar="RUN_DIR",
        help=f"the job's run dir (default: the newest run under ./{DEFAULT_ROOT})",
    )
    parser.add_argument(
        "--once", action="store_true", help="print one snapshot and exit (exit code 1 when no job is running there)"
    )


def main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or records.newest_run(DEFAULT_ROOT)
    if run_dir is None:
        print(
            f"phalanx top: no runs under ./{DEFAULT_ROOT}. HINT: pass the job's RUN_DIR "
            "(phalanx run prints it: 'run dir ...').",
            file=sys.stderr,
        )
        return 1
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        print(f"phalanx top: {printable(run_dir)} is not a directory. HINT: pass the job's RUN_DIR.", file=sys.stderr)
        return 1
    if args.once:
        status = records.read_status(run_dir)
        print(table.render(run_dir, status))
        return 0 if table.not_running_line(run_dir, status) is None else 1
    color = sys.stdout.isatty()
    try:
        while True:
            screen = table.render(run_dir, records.read_status(run_dir), color=color)
            sys.stdout.write(("\x1b[H\x1b[2J" if color else "\n") + screen + "\n")
            sys.stdout.flush()
            time.sleep(REFRESH_S)
    except KeyboardInterrupt:
        return 0
