"""describe_children: what the watchdog's report says of a rank's child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from phalanx.runtime.children import describe_children

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")


def _line_of(pid: int) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in describe_children() if line.startswith(f"pid {pid}: ")]
        if lines and "sleeping in" in lines[0]:
            return lines[0]
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} not seen asleep among {describe_children()}")


def test_a_forked_child_blocked_on_a_pipe_is_named_with_where_it_waits():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(read_end, 1)
        os._exit(0)
    try:
        line = _line_of(pid)
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
        assert line.startswith(f"pid {pid}: sleeping in {wchan}, 0.0 s CPU in "), line
        assert line.endswith(" s; forked from it"), line
    finally:
        os.write(write_end, b"x")
        os.waitpid(pid, 0)
        os.close(read_end)
        os.close(write_end)


def test_a_started_child_shows_its_command_and_its_own_children_are_not_listed():
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        line = _line_of(child.pid)
        assert line.endswith("; " + f"{sys.executable} -c {code}"[:120]), line  # commands cut at 120 characters
        grandchildren = describe_children(child.pid)
        deadline = time.monotonic() + 10
        while not grandchildren and time.monotonic() < deadline:
            time.sleep(0.05)
            grandchildren = describe_children(child.pid)
        assert len(grandchildren) == 1 and "time.sleep(60)" in grandchildren[0], grandchildren
        grandchild = grandchildren[0].split(":")[0]
        assert not any(line.startswith(grandchild + ":") for line in describe_children())
    finally:
        for line in describe_children(child.pid):
            os.kill(int(line.split(":")[0].split()[1]), 9)
        child.kill()
        child.wait()
