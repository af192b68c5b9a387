"""Opt-in stress test: a finished (or failed) job never dies at exit, on every way of starting ranks.

    PHALANX_STRESS_EXITS=500 scripts/test tests/stress -s      # hours on a 2-core machine

`test_no_forked_rank_exit_ever_aborts` runs the same job's ranks forked from one process that imported
torch once (exit_zygote.py): the ranks' own exits, N per path, at a fraction of the cost (about 1 s of
CPU a run instead of 5-10), several runs at a time, so the runs themselves load the cores.

Each case (launcher x ending) runs N times, round-robin, beside CPU load (one busy process per core,
or PHALANX_STRESS_BURNERS of them), and the runs in which any process aborted (`terminate called
...`, SIGABRT) or ended otherwise than expected (a normal end must exit 0 with every rank done; an
exception must fail with the planned error and nothing else) are counted per case. The counts are
printed at the end; with PHALANX_STRESS_REPORT=FILE each run's outcome is appended to FILE as it
happens (one JSON line), so a run stopped early still has its counts. Without PHALANX_STRESS_EXITS
it skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).parent / "exit_job.py"
RUN_TIMEOUT_S = 900  # a hang detector: on a 2-core machine under load ~15, one run took up to 300 s
ABORTED = re.compile(r"terminate called|SIGABRT|[Ss]ignal 6\b|exit code -6|exitcode -6|core dumped")
pytestmark = [pytest.mark.dist, pytest.mark.stress, pytest.mark.timeout(0)]  # bounded per run instead


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def command(launcher: str, mode: str, run_dir: Path) -> list[str]:
    """The command of one run; the preemption ending saves into RUN_DIR/ckpt, fresh for each run."""
    python = sys.executable
    job = [str(JOB), mode, *([str(run_dir / "ckpt")] if mode == "preemption" else [])]
    if launcher == "phalanx run":
        return [python, "-m", "phalanx", "run", "--nproc-per-node", "2", *job]
    if launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *job]
    if launcher == "mp.spawn adopt":
        return [python, *job, "--mp-spawn"]
    if launcher == "phalanx.spawn":
        return [python, *job, "--phalanx-spawn"]
    if launcher == "mpiexec":
        return [_mpiexec() or "mpiexec", "-n", "2", python, *job]
    raise ValueError(launcher)


LAUNCHERS = ["phalanx run", "torchrun", "mp.spawn adopt", "phalanx.spawn", "mpiexec"]
ENDINGS = ["normal", "exception", "preemption"]
PREEMPTED = re.compile(r"phalanx: preempted by SIGTERM at step \d+: checkpoint \S+ saved")


def expected(launcher: str, mode: str, proc: subprocess.CompletedProcess) -> str | None:
    """What is wrong with this run's ending, None if nothing: aborts are counted apart."""
    out = proc.stdout + proc.stderr
    if mode == "preemption":  # phalanx run exits 143 itself; other launchers report their workers' 143
        if launcher == "phalanx run" and proc.returncode != 143:
            return f"exit {proc.returncode}, not 143"
        if proc.returncode == 0:
            return "exit 0 after a preemption"
        return None if PREEMPTED.search(out) else "no 'preempted ... checkpoint ... saved' line"
    if mode == "normal":
        if proc.returncode != 0:
            return f"exit {proc.returncode}"
        done = sorted(re.findall(r"exit-job rank (\d) done", out))
        return None if done == ["0", "1"] else f"ranks done: {done}"
    if proc.returncode == 0:
        return "exit 0 after a planned failure"
    return (
        None
        if "planned failure of the exit stress test" in out
        else f"exit {proc.returncode} without the planned error"
    )


@pytest.fixture(scope="module")
def stress() -> dict:
    """The PHALANX_STRESS_* switches, read before the per-test guard hides every PHALANX_* variable."""
    raw = os.environ.get("PHALANX_STRESS_EXITS")
    if not raw:
        pytest.skip("opt-in: PHALANX_STRESS_EXITS=N runs every exit path N times beside CPU load (hours)")
    return {
        "runs": int(raw),
        "report": os.environ.get("PHALANX_STRESS_REPORT"),
        "burners": int(os.environ.get("PHALANX_STRESS_BURNERS") or os.cpu_count() or 2),
    }


@pytest.fixture(scope="module")
def cpu_load(stress):
    """Busy-looping processes (one per core by default) for the whole module, ended by pid afterwards."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(stress["burners"])]
    yield len(burners)
    for burner in burners:
        burner.kill()
        burner.wait()


def _has_mpi() -> bool:
    return _mpiexec() is not None and importlib.util.find_spec("mpi4py") is not None


def run_once(launcher: str, mode: str, env: dict, cwd: Path) -> tuple[str, str]:
    """("ok" | "aborted" | "wrong", details) for one run."""
    run_dir = Path(tempfile.mkdtemp(dir=cwd))
    try:
        proc = subprocess.run(
            command(launcher, mode, run_dir), cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as error:
        return "wrong", f"no exit within {RUN_TIMEOUT_S} s\n{str(error.stderr)[-3000:]}"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    text = proc.stdout + proc.stderr
    if ABORTED.search(text) or proc.returncode in (-6, 134):
        return "aborted", text[-3000:]
    problem = expected(launcher, mode, proc)
    return ("ok", "") if problem is None else ("wrong", f"{problem}\n{text[-3000:]}")


def test_no_exit_ever_aborts(stress, cpu_load, tmp_path):
    """Round-robin over every case, so counts stay even however long the run is allowed to go on;
    with PHALANX_STRESS_REPORT=FILE each run's outcome is appended to FILE as it happens."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cases = [(launcher, mode) for launcher in LAUNCHERS if launcher != "mpiexec" or _has_mpi() for mode in ENDINGS]
    counts = {case: {"ok": 0, "aborted": 0, "wrong": 0} for case in cases}
    first_problem: dict[str, str] = {}
    report, runs_per_case = stress["report"], stress["runs"]
    for i in range(runs_per_case):
        for launcher, mode in cases:
            outcome, details = run_once(launcher, mode, env, tmp_path)
            counts[(launcher, mode)][outcome] += 1
            if outcome != "ok":
                first_problem.setdefault(outcome, f"{launcher}, {mode}, run {i}: {details}")
            if report:
                with open(report, "a") as f:
                    f.write(
                        json.dumps(
                            {"launcher": launcher, "ending": mode, "run": i, "outcome": outcome, "burners": cpu_load}
                        )
                        + "\n"
                    )
    for (launcher, mode), count in counts.items():
        print(f"exit stress: {launcher}, {mode}: {json.dumps(count)}")
    if not _has_mpi():
        print("exit stress: mpiexec not covered (no MPI: pip install mpich mpi4py)")
    total = {k: sum(c[k] for c in counts.values()) for k in ("ok", "aborted", "wrong")}
    assert total["aborted"] == 0, f"{total['aborted']} runs aborted at exit; the first: {first_problem['aborted']}"
    assert total["wrong"] == 0, f"{total['wrong']} runs ended wrongly; the first: {first_problem['wrong']}"


def test_no_forked_rank_exit_ever_aborts(stress, cpu_load, tmp_path):
    """exit_zygote.py: each worker-side path (a group made from the launcher's variables, an adopted
    group) x each ending, N runs of 2 forked ranks, 4 runs at a time; every rank ends through the
    interpreter's own exit. Counted as in the test above, with the same report file."""
    report = stress["report"] or str(tmp_path / "exits.jsonl")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        TMPDIR=str(tmp_path),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    before = Path(report).read_text().count("\n") if Path(report).exists() else 0
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "exit_zygote.py"),
            str(stress["runs"]),
            report,
            "--concurrent",
            "4",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in Path(report).read_text().splitlines()[before:]]
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for row in rows:
        counts.setdefault((row["launcher"], row["ending"]), {"ok": 0, "aborted": 0, "wrong": 0})[row["outcome"]] += 1
    for (path, mode), count in sorted(counts.items()):
        print(f"exit stress: {path}, {mode}: {json.dumps(count)}")
    bad = [row for row in rows if row["outcome"] != "ok"]
    assert not bad, f"{len(bad)} of {len(rows)} runs ended badly; the first: {bad[0]}"
    assert all(sum(c.values()) == stress["runs"] for c in counts.values()) and len(counts) == 6, counts
