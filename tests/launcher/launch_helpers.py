"""Helpers for black-box launcher tests: run the CLI in a subprocess with a hard time-out.

(A uniquely named module rather than conftest.py, so it cannot collide with other test folders.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
RECORD_ENV = SCRIPTS / "record_env.py"
LAUNCH_TIMEOUT_S = 120  # a 2-rank launch costs ~3-10 s here; generous for a loaded machine


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_cli(
    args: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = LAUNCH_TIMEOUT_S,
    module: str = "phalanx",
) -> Result:
    """`python -m phalanx ARGS` (or another module, e.g. torch.distributed.run)."""
    full_env = {**os.environ, **(env or {})}
    full_env = {key: value for key, value in full_env.items() if value is not None}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def read_records(out_dir: Path) -> dict[int, dict]:
    """rank -> what record_env.py wrote."""
    return {int(path.stem[4:]): json.loads(path.read_text()) for path in out_dir.glob("rank*.json")}
