"""Test worker: prints the run dir it was given, logs through phalanx's logger, logs one metric."""

import sys

from phalanx import Phalanx
from phalanx.logging.rank_log import get_logger

px = Phalanx()
# One write per line: workers' stdout is unbuffered (as under torchrun's `python -u`), and print()
# writes the text and the newline separately, so two ranks' lines could interleave mid-line.
sys.stdout.write(f"RUN_DIR rank {px.rank} {px.run_dir}\n")
get_logger("test").info("hello from rank %d", px.rank)
px.log({"rank_logged": px.rank}, step=0)
