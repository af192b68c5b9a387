"""Launching the observe tests' training script (scripts/train_straggler.py) under `phalanx run`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "train_straggler.py"


def phalanx_run(run_dir: Path, *script_args: str, flags: tuple[str, ...] = (), **popen: object) -> subprocess.Popen:
    """`phalanx run --nproc-per-node 2 --run-dir RUN_DIR [flags] train_straggler.py ARGS`, started."""
    env = {**os.environ, "PHALANX_RUN_DIR": str(run_dir)}
    return subprocess.Popen([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", "--run-dir",
                             str(run_dir), *flags, str(SCRIPT), *script_args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def straggler_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "observe" / "stragglers.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
