"""How many workers this node can run: refused before any starts when the request is beyond it.

Two bounds, each read before torch is imported:
- the cores: more than WORKERS_PER_CORE workers a core is no training job (each rank's collectives
  wait on the slowest, and every one of them is descheduled most of the time);
- the tasks the kernel lets this launcher make: its pids cgroup (`pids.max` less `pids.current`,
  the tightest of its cgroup and the ones above it, v1 or v2) and, for a user other than root, the
  user's RLIMIT_NPROC less the threads the user already runs. Each worker is a process of about
  TASKS_PER_WORKER threads (gloo's, OpenMP's, the watchdog's: 18 measured on 4 CPU ranks). Beyond
  that bound a fork fails or waits, and the launch hung with an empty launcher.log.

`--allow-oversubscribe` starts them anyway: the user says the count is meant.
"""

from __future__ import annotations

import dataclasses
import os
import resource

WORKERS_PER_CORE = 8
"""More workers than this per core are refused (8 ranks on 2 cores train; 99999 cannot)."""
TASKS_PER_WORKER = 20
"""Threads one worker holds (18 measured: 4 CPU ranks under gloo, fork and spawn alike)."""
LAUNCHER_TASKS = 8
"""Threads the launcher itself adds once the agent and its store run."""


@dataclasses.dataclass(frozen=True)
class TaskLimit:
    """A cap on the tasks (threads) this launcher may still make, and where it comes from."""

    free: int
    source: str


def _cgroup_dirs() -> list[str]:
    """This process's pids cgroup directory (v1 controller or v2 unified) and those above it."""
    found = []
    try:
        with open("/proc/self/cgroup") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            roots = ["/sys/fs/cgroup/pids"]
        elif controllers == "":
            roots = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        else:
            continue
        for root in roots:
            parts = [part for part in path.split("/") if part]
            for depth in range(len(parts), -1, -1):
                found.append(os.path.join(root, *parts[:depth]))
    return found


def _read(path: str) -> str | None:
    try:
        with open(path) as fp:
            return fp.read().strip()
    except (OSError, ValueError):
        return None


def cgroup_limit() -> TaskLimit | None:
    """The tightest pids cgroup above this process, or None where none limits it."""
    tightest = None
    for where in _cgroup_dirs():
        limit, current = _read(os.path.join(where, "pids.max")), _read(os.path.join(where, "pids.current"))
        if limit is None or current is None or not limit.isdigit() or not current.isdigit():
            continue  # absent, or "max"
        free = int(limit) - int(current)
        if tightest is None or free < tightest.free:
            tightest = TaskLimit(free, f"the pids cgroup {where} (pids.max {limit}, {current} in use)")
    return tightest


def _user_threads(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        status = _read(f"/proc/{pid}/status") or ""
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def nproc_rlimit() -> TaskLimit | None:
    """RLIMIT_NPROC less the threads this user runs (root is not held to it), or None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or not os.path.isdir("/proc"):
        return None
    used = _user_threads(os.getuid())
    return TaskLimit(soft - used, f"ulimit -u {soft} ({used} threads of this user running)")


def task_limit() -> TaskLimit | None:
    """The tighter of the cgroup's and the rlimit's caps, or None."""
    limits = [limit for limit in (cgroup_limit(), nproc_rlimit()) if limit is not None]
    return min(limits, key=lambda limit: limit.free) if limits else None


def workers_that_fit(limit: TaskLimit) -> int:
    return max(0, (limit.free - LAUNCHER_TASKS) // TASKS_PER_WORKER)


def check(nproc: int, num_cores: int, tasks: TaskLimit | None, allowed: bool) -> str | None:
    """The refusal of `nproc` workers on this node, or None when they fit (or `allowed`)."""
    if allowed:
        return None
    bounds = [(num_cores * WORKERS_PER_CORE, f"{WORKERS_PER_CORE} per core on its {num_cores} core(s)")]
    if tasks is not None:
        bounds.append((workers_that_fit(tasks), f"about {TASKS_PER_WORKER} threads each under {tasks.source}"))
    fits, why = min(bounds, key=lambda bound: bound[0])
    if nproc <= fits:
        return None
    use = f"--nproc-per-node {fits}" if fits else "fewer processes elsewhere (none fits here now)"
    return (
        f"--nproc-per-node {nproc}: this node can run at most {fits} worker(s) ({why}). "
        f"HINT: use {use}, or add --allow-oversubscribe if {nproc} is meant"
    )
