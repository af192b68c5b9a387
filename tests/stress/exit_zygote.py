"""Many rank exits fast: a process that imported torch and phalanx once forks the two ranks of each
run, and every rank ends through the interpreter's own exit (atexit hooks, the final garbage
collection, gloo's threads), as a rank started by a launcher does.

    python exit_zygote.py RUNS REPORT.jsonl [--concurrent K]

A fresh interpreter costs seconds of CPU to import torch, so 500 exits per path through the real
launchers would take a day on a 2-core machine; forked ranks cost a fraction of a second each. The
worker-side exit paths covered, each ending normally, by an exception (rank 1 raises mid-epoch) and by
preemption (SIGTERM to rank 0 at the second step):
- `env`: `Phalanx()` makes the group from RANK/WORLD_SIZE/MASTER_* (what `phalanx run`, torchrun and
  mpiexec give their workers);
- `adopt`: the script makes its own gloo group (`file://`), `Phalanx()` adopts it, the script ends it
  (what an mp.spawn script does).
The launchers' own processes are not re-created per run here: test_exit_paths.py runs those.
Each run's outcome is appended to REPORT as one JSON line, as test_exit_paths.py does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401 - imported once, before any fork
import torch.distributed  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent))
import exit_job  # noqa: E402 - beside this file


def _import_everything() -> None:
    """Every phalanx module and what they import, once here instead of in each forked rank."""
    import importlib
    import pkgutil

    import phalanx
    import torch._dynamo  # noqa: F401 - a first optimizer imports it (seconds)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    for module in pkgutil.walk_packages(phalanx.__path__, "phalanx."):
        if module.name != "phalanx.__main__":
            importlib.import_module(module.name)


PATHS = ["env", "adopt"]
ENDINGS = ["normal", "exception", "preemption"]
RUN_TIMEOUT_S = 300
ABORTED = re.compile(r"terminate called|SIGABRT|[Ss]ignal 6\b|core dumped")
PREEMPTED = re.compile(r"phalanx: preempted by SIGTERM at step \d+: checkpoint \S+ saved")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, path: str, mode: str, run_dir: Path, port: int) -> None:
    """The forked rank: its output into run_dir, then the job; returning ends the process the way a
    script ends (SystemExit unwinds to the top and the interpreter finalizes)."""
    out = os.open(run_dir / f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ["PHALANX_RUN_DIR"] = str(run_dir / "runs")
    ckpt = str(run_dir / "ckpt") if mode == "preemption" else None
    if path == "adopt":
        exit_job._mp_spawn_worker(rank, mode, str(run_dir / "init"), ckpt)
    else:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        exit_job.job(mode, ckpt)
    print(f"exit-zygote rank {rank} returned", flush=True)


def _start(path: str, mode: str, root: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    port = _free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _rank(rank, path, mode, run_dir, port)
            raise SystemExit(0)  # unwinds through main() to the interpreter's exit, with no handler on the way
        pids.append(pid)
    return {"path": path, "ending": mode, "dir": run_dir, "pids": pids, "codes": {}, "started": time.monotonic()}


def _judge(run: dict) -> tuple[str, str]:
    """("ok" | "aborted" | "wrong", details) once both ranks have ended."""
    outs = [(run["dir"] / f"rank{r}.out").read_text(errors="replace") for r in range(2)]
    codes = [run["codes"][pid] for pid in run["pids"]]
    text = "\n".join(f"--- rank {r} (exit {codes[r]}):\n{outs[r][-2000:]}" for r in range(2))
    if any(ABORTED.search(o) for o in outs) or -signal.SIGABRT in codes:
        return "aborted", text
    mode = run["ending"]
    if mode == "normal":
        ok = codes == [0, 0] and all(f"exit-job rank {r} done" in outs[r] for r in range(2))
    elif mode == "exception":
        ok = codes[1] == 1 and exit_job.PLANNED in outs[1] and codes[0] != 0
    else:
        ok = all(c != 0 for c in codes) and bool(PREEMPTED.search(outs[0] + outs[1]))
    return ("ok", "") if ok else ("wrong", text)


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(argv: list[str]) -> int:
    runs, report = int(argv[0]), Path(argv[1])
    concurrent = int(argv[argv.index("--concurrent") + 1]) if "--concurrent" in argv else 1
    _import_everything()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    assert threads == 1, f"{threads} threads before forking: a forked rank would inherit locks held by them"
    root = Path(tempfile.mkdtemp(prefix="phalanx-exit-zygote-"))
    queue = [(path, mode, i) for i in range(runs) for path in PATHS for mode in ENDINGS]
    running: dict[int, dict] = {}  # pid -> its run
    counts: dict[str, int] = {}
    while queue or running:
        while queue and len({id(r) for r in running.values()}) < concurrent:
            path, mode, i = queue.pop(0)
            run = _start(path, mode, root)
            run["i"] = i
            running.update({pid: run for pid in run["pids"]})
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            for run in {id(r): r for r in running.values()}.values():
                if time.monotonic() - run["started"] > RUN_TIMEOUT_S:
                    for p in run["pids"]:
                        if p not in run["codes"]:
                            os.kill(p, signal.SIGKILL)
                    run["hung"] = True
            time.sleep(0.05)
            continue
        run = running.pop(pid)
        run["codes"][pid] = _code(status)
        run["cpu_s"] = run.get("cpu_s", 0.0) + usage.ru_utime + usage.ru_stime
        if len(run["codes"]) < 2:
            continue
        outcome, details = ("wrong", "no exit within the limit") if run.get("hung") else _judge(run)
        key = f"{run['path']} {run['ending']} {outcome}"
        counts[key] = counts.get(key, 0) + 1
        with open(report, "a") as f:
            f.write(
                json.dumps(
                    {
                        "launcher": f"forked ({run['path']})",
                        "ending": run["ending"],
                        "run": run["i"],
                        "outcome": outcome,
                        "s": round(time.monotonic() - run["started"], 2),
                        "cpu_s": round(run["cpu_s"], 2),
                        "load": os.getloadavg()[0],
                        **({"details": details[-4000:]} if outcome != "ok" else {}),
                    }
                )
                + "\n"
            )
        _remove(run["dir"])
    _remove(root)
    print(json.dumps(counts, sort_keys=True))
    return 0


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
