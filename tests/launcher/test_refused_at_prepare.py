"""A layout the script's model cannot take (PHALANX_PP=2 on the wine example: no blocks to cut) is
known only at `px.prepare(model)`, where every rank refuses it the same: said once, with exit 2 and
the fix, never as a traceback per rank (phalanx/refusal.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import refusal
from tests.dist.harness import free_port, rank_env
from tests.launcher.launch_helpers import LAUNCH_TIMEOUT_S, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "wine.py"
CUT = "cannot cut SimpleNN into pipeline stages"


def test_phalanx_run_says_a_refused_layout_once_and_exits_2(tmp_path):
    """It was rank 1's traceback (25 lines) and exit 1."""
    pytest.importorskip("sklearn")
    result = run_cli(
        ["run", "--nproc-per-node", "2", "--max-restarts", "1", str(WINE), "--epochs", "1"],
        cwd=tmp_path,
        env={"PHALANX_PP": "2", "PHALANX_RUN_DIR": str(tmp_path / "run")},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    said = [line for line in lines if CUT in line]
    assert len(said) == 1 and said[0].startswith(f"phalanx run: error: {CUT}"), result.stderr
    assert "HINT: hold the repeated blocks in an nn.ModuleList" in said[0]
    assert "Traceback" not in result.stderr
    assert "phalanx: restart" not in result.stderr  # refused again on every attempt: not restarted
    assert "phalanx (rank 1): refused at prepare; the launcher says why" in lines


REFUSED = """
import torch
from phalanx import Phalanx
px = Phalanx(pp=2)
px.prepare(torch.nn.Linear(2, 2))
"""


def test_without_a_phalanx_launcher_rank_0_says_it_and_the_others_a_short_line(tmp_path):
    """Under torchrun (or any launcher of its own) each rank printed the same traceback."""
    script = tmp_path / "refused.py"
    script.write_text(REFUSED)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=rank_env(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outputs
    assert "Traceback" not in outputs[0] + outputs[1], outputs
    assert [line for line in outputs[0].splitlines() if "refused" in line] == [
        line for line in outputs[0].splitlines() if line.startswith("phalanx: refused at prepare: cannot cut Linear")
    ]
    assert "cannot cut Linear" not in outputs[1]
    assert "phalanx (rank 1): refused at prepare; rank 0 says why" in outputs[1].splitlines()


def test_the_refusal_round_trips_through_the_error_file(tmp_path):
    refusal.write(str(tmp_path / "error.json"), "pp=2: no blocks. HINT: ...")
    import json

    data = json.loads((tmp_path / "error.json").read_text())
    assert refusal.from_error_file_data(data) == "pp=2: no blocks. HINT: ..."
    assert data["message"]["message"] == "pp=2: no blocks. HINT: ..."  # what torch's agent shows
    assert refusal.from_error_file_data({"message": "<NONE>"}) is None


def test_a_value_error_at_prepare_becomes_a_refusal_that_is_still_a_value_error():
    with pytest.raises(ValueError, match="no blocks") as raised:
        with refusal.refusing():
            raise ValueError("no blocks")
    assert isinstance(raised.value, refusal.Refused)
    assert refusal.line(0, "no blocks", launcher=True) is None
    assert refusal.line(0, "no blocks", launcher=False) == "phalanx: refused at prepare: no blocks"
