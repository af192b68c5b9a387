"""What a rank's child processes are doing, for the watchdog's report of a stall.

A rank that waits on its DataLoader is waiting on its worker processes (or on an async save's
writer helper): its own stack ends in a queue read and says nothing about why. Each child's state
and the kernel function it sleeps in (/proc's `wchan`: a lock's `futex_wait`, a pipe's `pipe_read`)
tell a deadlocked worker from one that waits for work or one that is still computing. Linux only;
elsewhere the list is empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O",
    "Z": "a zombie (ended, not reaped)",
    "T": "stopped",
    "t": "stopped by a tracer",
}


@dataclass(frozen=True)
class ProcessFacts:
    """What /proc shows of one process: its state letter, parent, the kernel function it sleeps in
    ("" when running or hidden), CPU seconds, seconds since it started, and its command line."""

    pid: int
    ppid: int
    state: str
    wchan: str
    cpu_s: float
    age_s: float
    command: bytes

    @property
    def command_text(self) -> str:
        return self.command.replace(b"\0", b" ").decode(errors="replace").strip()


def read_process(pid: int) -> ProcessFacts | None:
    """The process's facts, or None when it has ended (or /proc is not there)."""
    try:
        fields = _stat_fields(pid)
        wchan = _read(f"/proc/{pid}/wchan").decode(errors="replace").strip()
        command = _read(f"/proc/{pid}/cmdline")
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return ProcessFacts(
        pid,
        int(fields[1]),
        fields[0],
        "" if wchan == "0" else wchan,
        (int(fields[11]) + int(fields[12])) / ticks,
        uptime - int(fields[19]) / ticks,
        command,
    )


def describe_children(pid: int | None = None) -> list[str]:
    """One line per child process of `pid` (this process by default): pid, state, where it waits,
    CPU time and age, and its command when it differs from the parent's (a forked worker runs the
    parent's)."""
    pid = os.getpid() if pid is None else pid
    parent = read_process(pid)
    if parent is None:
        return []  # no /proc here, or the process has ended
    names = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    lines = []
    for child in sorted(names):
        try:
            if int(_stat_fields(child)[1]) != pid:
                continue
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        facts = read_process(child)
        if facts is None:
            continue
        state = STATES.get(facts.state, facts.state)
        where = f" in {facts.wchan}" if facts.wchan else ""
        what = "forked from it" if facts.command == parent.command else facts.command_text[:120]
        lines.append(f"pid {child}: {state}{where}, {facts.cpu_s:.1f} s CPU in {facts.age_s:.0f} s; {what}")
    return lines


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields from the state on (after the command name, which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
