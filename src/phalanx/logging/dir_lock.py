"""One job per directory: a lock on a run or checkpoint directory, naming its holder.

Two jobs in one checkpoint directory resume each other's checkpoints and fail on each other's step
names; in one run directory their metrics rows interleave. `phalanx run` takes a lock on each of its
directories before any worker starts and holds it for the whole job (the elastic agent's restarts run
in the same launcher, so a restart of the job is never refused).

The lock is `DIR/.phalanx-lock`: an exclusive `flock` on it, held by the launcher's open file (its
forked workers close their copy), and its text naming the holder: host, pid, start time. A second job
is refused with those. The kernel drops a flock when its process dies, SIGKILL included, so a lock
left by a killed job on this host is taken over at once, and said. Another host's lock may not be
visible through a network filesystem's flock: there the holder renews the file's time every
LEASE_S / 4 seconds, and a lock from another host is taken over only when older than LEASE_S (its
holder stopped renewing: the node was lost). A checkpoint directory in object storage has no flock
nor atomic create through fsspec: it is not locked (docs/reliability.md says so).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import threading
import time

LOCK_NAME = ".phalanx-lock"
LEASE_S = 60.0
"""A lock from another host whose holder has not renewed it for this long is taken over."""


class DirectoryInUse(RuntimeError):
    """Another live job holds the directory."""


@dataclasses.dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {when}"


def _read_holder(path: str) -> Holder | None:
    try:
        with open(path) as fp:
            data = json.load(fp)
        return Holder(str(data["host"]), int(data["pid"]), float(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or cut off while written: nobody named


class DirLock:
    """A held lock; `release()` (or the process's end) lets it go."""

    def __init__(self, directory: str, fd: int, took_over: Holder | None):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.took_over = took_over
        """The holder of a lock left behind (a killed job), when this one replaced it."""
        self._fd: int | None = fd
        self._stop = threading.Event()
        os.register_at_fork(after_in_child=self._forget)  # the launcher holds it, not its workers
        threading.Thread(target=self._renew, name="phalanx-dir-lock", daemon=True).start()

    def _forget(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the child's copy only: the flock stays with the parent's
            self._fd = None
        self._stop.set()

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock file, then drop the lock (a job ended cleanly leaves nothing behind)."""
        self._stop.set()
        if self._fd is None:
            return
        try:
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        finally:
            os.close(self._fd)
            self._fd = None


def _refusal(directory: str, what: str, holder: Holder | None, path: str) -> DirectoryInUse:
    who = holder.describe() if holder else "a job that has not yet written its name"
    return DirectoryInUse(
        f"the {what} {directory} is in use by another job: {who} (its lock: {path}). Two jobs in one "
        f"directory resume each other's checkpoints and mix their metrics. HINT: wait for that job to "
        f"end (or stop it), or give this job a {what} of its own"
    )


def acquire(directory: str, what: str) -> DirLock:
    """Lock `directory` (created if needed) for this process, or raise DirectoryInUse naming the holder.
    `what` names the directory in the message ("checkpoint directory", "run directory")."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    for _ in range(20):  # retried only when the file was replaced between open and flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(directory, what, _read_holder(path), path) from None
        except OSError:  # no flock on this filesystem: the holder's pid and the lease decide
            left = _read_holder(path)
            if left is not None and left.host == socket.gethostname() and _alive(left.pid):
                os.close(fd)
                raise _refusal(directory, what, left, path) from None
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)  # its holder removed it as it ended: lock the new one
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        left = _read_holder(path)
        if left is not None and left.host != socket.gethostname():
            age = time.time() - os.fstat(fd).st_mtime
            if age < LEASE_S:  # another node's live job: its flock may not reach this host
                os.close(fd)
                raise _refusal(directory, what, left, path)
        _write_holder(fd)
        return DirLock(directory, fd, left)
    raise DirectoryInUse(f"could not lock {directory}: its lock file {path} keeps being replaced")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_holder(fd: int) -> None:
    text = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)
