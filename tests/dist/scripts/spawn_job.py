"""phalanx.spawn from a script, spawn-safe under `if __name__ == "__main__":`.

    python spawn_job.py OUT_DIR START_METHOD
Writes each rank's report (returned to the caller), then the error a failing rank raises.
"""

import json
import sys
from pathlib import Path

import phalanx
from phalanx.launch.spawn import SpawnError
from tests.dist.spawn_workloads import shard_report


def fail_on_rank_one() -> None:
    px = phalanx.Phalanx()
    if px.rank == 1:
        raise ValueError("rank one cannot go on")
    px.wait_for_everyone()


if __name__ == "__main__":
    out, start_method = Path(sys.argv[1]), sys.argv[2]
    reports = phalanx.spawn(shard_report, nprocs=2, start_method=start_method)
    (out / "reports.json").write_text(json.dumps(reports))
    try:
        phalanx.spawn(fail_on_rank_one, nprocs=2, start_method=start_method)
    except SpawnError as error:
        (out / "error.txt").write_text(str(error))
