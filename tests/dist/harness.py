"""Run a test function on N CPU ranks over gloo, each in a fresh process, with a hard timeout.

`run_ranks("tests.dist.workloads:train", world_size=2, args=(...))` starts N processes with
torchrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT on loopback), calls
the function in each and returns each rank's return value (anything torch.save can write).
A rank that fails or outlives the timeout fails the test with every rank's output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from phalanx.runtime.children import read_process

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(
    rank: int, world_size: int, port: int, extra: dict[str, str] | None = None, local_world_size: int | None = None
) -> dict[str, str]:
    """torchrun's variables for `rank`; `local_world_size` < world_size plays several nodes."""
    env = dict(os.environ)
    local = local_world_size or world_size
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank % local),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local),
        GROUP_RANK=str(rank // local),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    env.update(extra or {})
    return env


class RanksFailed(AssertionError):
    pass


def run_ranks(
    target: str,
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    local_world_size: int | None = None,
) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="phalanx-test-") as tmp:
        out = Path(tmp)
        torch.save(tuple(args), out / "args.pt")
        port = free_port()
        procs = []
        for rank in range(world_size):
            log = open(out / f"rank{rank}.log", "w+")
            cmd = [sys.executable, "-m", "tests.dist.worker", target, str(out)]
            procs.append(
                (
                    subprocess.Popen(
                        cmd,
                        cwd=ROOT,
                        env=rank_env(rank, world_size, port, env, local_world_size),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                timed_out = True
                for p, _ in procs:
                    p.kill()
                break
            time.sleep(0.05)
        for p, _ in procs:
            p.wait()
        logs = []
        for rank, (p, log) in enumerate(procs):
            log.seek(0)
            logs.append(f"--- rank {rank} (exit {p.returncode}) ---\n{log.read()}")
            log.close()
        if timed_out or any(p.returncode != 0 for p, _ in procs):
            why = f"timed out after {timeout:.0f}s" if timed_out else "a rank failed"
            raise RanksFailed(f"{target} on {world_size} ranks: {why}\n" + "\n".join(logs))
        return [torch.load(out / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def run_command(
    command: Sequence[str], env: dict[str, str], timeout: float, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` for a launcher. One that has not
    finished within `timeout` (its output not closed: a process it started may hold it) fails the
    test with its output so far and each process still holding that output, which are then killed."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        holders = _holding(os.fstat(proc.stderr.fileno()).st_ino)  # type: ignore[union-attr]
        table = "\n".join(_describe(pid) for pid in holders)
        launcher = "still running" if proc.poll() is None else f"ended with {proc.returncode}"
        for pid in {proc.pid, *holders}:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        out, err = proc.communicate()  # all of it: communicate keeps what it read before the timeout
        raise RanksFailed(
            f"{' '.join(command)}: no end within {timeout:.0f} s (the launcher {launcher}); "
            f"processes holding its output:\n{table}\n--- its stderr, last part ---\n{err[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _holding(pipe_inode: int) -> list[int]:
    """The processes with the pipe of that inode among their open files."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            links = {os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")}
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if f"pipe:[{pipe_inode}]" in links and int(entry) != os.getpid():
            found.append(int(entry))
    return sorted(found)


def _describe(pid: int) -> str:
    """`pid (parent, state, wait channel): command line` of a process, as far as /proc still shows it."""
    facts = read_process(pid)
    if facts is None:
        return f"{pid}: ended"
    return (
        f"{pid} (parent {facts.ppid}, state {facts.state}, waiting in {facts.wchan or '-'}): {facts.command_text[:300]}"
    )
