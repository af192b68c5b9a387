"""Two ranks under `phalanx run` with no PHALANX_RUN_DIR: the launcher picks runs/<time>, both ranks use it;
PHALANX_LOG_ALL_RANKS=1 shows every rank's INFO with its [rank N] prefix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]
SCRIPT = Path(__file__).parent / "scripts" / "report_run_dir.py"


def test_ranks_share_one_fresh_run_dir_and_log_with_prefixes(tmp_path):
    result = run_cli(
        ["run", "--nproc-per-node", "2", str(SCRIPT)],
        cwd=tmp_path,
        env={"PHALANX_RUN_DIR": None, "PHALANX_LOG_ALL_RANKS": "1", "PHALANX_LOG_SINKS": None},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    dirs = dict(re.findall(r"RUN_DIR rank (\d) (\S+)", result.stdout))
    assert set(dirs) == {"0", "1"} and dirs["0"] == dirs["1"]
    run_dir = Path(dirs["0"])
    assert run_dir.parent == tmp_path / "runs" and re.fullmatch(r"\d{8}-\d{6}", run_dir.name)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    for rank in (0, 1):
        assert f"[rank {rank}] INFO phalanx.test: hello from rank {rank}" in result.stderr
        assert f"hello from rank {rank}" in (run_dir / "logs" / f"rank{rank}.log").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rank_logged"] for r in rows] == [0]  # only the main process writes metrics
