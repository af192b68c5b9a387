"""What a rank's child processes are doing, for the watchdog's report of a stall.

A rank that waits on its DataLoader is waiting on its worker processes (or on an async save's
writer helper): its own stack ends in a queue read and says nothing about why. Each child's state
and the kernel function it sleeps in (/proc's `wchan`: a lock's `futex_wait`, a pipe's `pipe_read`)
tell a deadlocked worker from one that waits for work or one that is still computing. Linux only;
elsewhere the list is empty.
"""
from __future__ import annotations

import os

STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "Z": "a zombie (ended, not reaped)",
          "T": "stopped", "t": "stopped by a tracer"}


def describe_children(pid: int | None = None) -> list[str]:
    """One line per child process of `pid` (this process by default): pid, state, where it waits,
    CPU time and age, and its command when it differs from the parent's (a forked worker runs the
    parent's)."""
    pid = os.getpid() if pid is None else pid
    try:
        names = os.listdir("/proc")
        parent = _read(f"/proc/{pid}/cmdline")
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError):
        return []
    lines = []
    for name in sorted(names, key=lambda n: (len(n), n)):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if int(fields[1]) != pid:
                continue
            wchan = _read(f"/proc/{name}/wchan").decode(errors="replace").strip()
            command = _read(f"/proc/{name}/cmdline")
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        state = STATES.get(fields[0], fields[0])
        where = f" in {wchan}" if wchan and wchan != "0" else ""
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        age = uptime - int(fields[19]) / ticks
        what = "forked from it" if command == parent else command.replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        lines.append(f"pid {name}: {state}{where}, {cpu:.1f} s CPU in {age:.0f} s; {what}")
    return lines


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
