"""Test worker: prints the run dir it was given, logs through phalanx's logger, logs one metric."""
from phalanx import Phalanx
from phalanx.logging.rank_log import get_logger

px = Phalanx()
print(f"RUN_DIR rank {px.rank} {px.run_dir}", flush=True)
get_logger("test").info("hello from rank %d", px.rank)
px.log({"rank_logged": px.rank}, step=0)
