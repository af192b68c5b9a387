"""Settings no script took are named while the job runs, not only at its end (issue 41 item 5):
a plain torch script given --mixed-precision bf16 joins its group and waits; the launcher's
"had no effect" line comes while it waits, and is not said again at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.launcher.launch_helpers import SCRIPTS

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]


def test_the_settings_no_script_took_are_named_while_the_job_runs(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "run",
            "--nproc-per-node",
            "2",
            "--mixed-precision",
            "bf16",
            "--run-dir",
            str(tmp_path / "run"),
            str(SCRIPTS / "joins_then_waits.py"),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("had no effect" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines)[-3000:]
            time.sleep(0.2)
        assert proc.poll() is None  # said while the workers wait for go: the job runs
        (tmp_path / "go").write_text("")
        assert proc.wait(timeout=60) == 0, "\n".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        assert proc.stderr is not None
        proc.stderr.close()
    (line,) = [line for line in lines if "had no effect" in line]  # once: not again at the end
    assert line.startswith(
        "phalanx run: warning: --mixed-precision bf16 had no effect: joins_then_waits.py never created Phalanx()"
    ), line
