"""The test harness's launcher runner: a command whose output stays open past its timeout fails the
test naming each process that still holds that output, and leaves none of them running."""

import os
import sys
import time
from pathlib import Path

import pytest

from tests.dist.harness import RanksFailed, run_command

# Starts a child in a session of its own that keeps the inherited output open, then exits at once:
# the launcher has ended, yet its output is not closed (as a helper outliving its rank would do).
ORPHAN = (
    "import subprocess, sys; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
    "print('launcher done', file=sys.stderr, flush=True)"
)


def test_a_process_holding_the_output_past_the_timeout_is_named_and_killed(tmp_path):
    with pytest.raises(RanksFailed) as failed:
        run_command([sys.executable, "-c", ORPHAN], dict(os.environ), timeout=3, cwd=tmp_path)
    message = str(failed.value)
    assert "no end within 3 s (the launcher ended with 0); processes holding its output:" in message
    assert "time.sleep(60)" in message and "launcher done" in message
    holders = [line for line in message.splitlines() if "time.sleep(60)" in line and "(parent" in line]
    assert len(holders) == 1
    pid = int(holders[0].split()[0])
    for _ in range(100):  # killed: a zombie until its new parent reaps it, then gone
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"{pid} still runs")


def test_a_command_that_ends_returns_its_output(tmp_path):
    done = run_command(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        dict(os.environ),
        timeout=60,
        cwd=tmp_path,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
