"""A rank that raises, hangs, dies or leaves early: the job ends fast and says which rank, where."""

import os
import re
import time

import pytest

from tests.dist.harness import ROOT, RanksFailed, run_ranks
from tests.launcher.launch_helpers import Result, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]

WATCHDOG_S = 5.0
SCRIPT_PATH = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # this tree's phalanx, not the install's


def misbehave(how: str) -> tuple[str, float]:
    """Run the 2-rank job; return its output and the seconds from rank 1's misbehaviour to the end."""
    with pytest.raises(RanksFailed) as failed:
        run_ranks("tests.dist.failure_workloads:misbehave_at_step_3", 2, args=(how, WATCHDOG_S), timeout=120)
    ended = time.time()
    text = str(failed.value)
    assert "timed out" not in text.splitlines()[0], text
    started = float(re.search(r"misbehaves \(\w+\) at step 3 at t=([\d.]+)", text).group(1))
    return text, ended - started


def rank_output(text: str, rank: int) -> str:
    return text.split(f"--- rank {rank} ")[1].split("\n--- rank ")[0]


def launch(how: str) -> tuple[Result, float]:
    """The same job through `python -m phalanx run --watchdog-timeout 5` (fork mode, agent's store)."""
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--watchdog-timeout",
            str(WATCHDOG_S),
            str(ROOT / "tests/dist/scripts/misbehave.py"),
            how,
        ],
        cwd=ROOT,
        env=SCRIPT_PATH,
        timeout=120,
    )
    ended = time.time()
    started = float(re.search(r"misbehaves \(\w+\) at step 3 at t=([\d.]+)", result.stdout).group(1))
    return result, ended - started


def test_rank_that_raises_ends_the_job_within_30s_with_its_traceback():
    result, seconds = launch("raise")
    assert seconds < 30, result.stderr
    assert result.returncode != 0
    assert "phalanx: rank 1 (local rank 1 on node 0) failed with exit code 1" in result.stderr, result.stderr[-3000:]
    summary = result.stderr[result.stderr.index("phalanx: rank 1 (local rank 1 on node 0) failed with exit code 1") :]
    assert "Traceback (most recent call last)" in summary
    assert 'misbehave_at_step_3\n    raise ValueError("rank 1 fails on purpose at step 3")' in summary
    assert "ValueError: rank 1 fails on purpose at step 3" in summary


def test_rank_that_hangs_is_named_with_its_step_and_every_stack():
    result, seconds = launch("sleep")
    assert seconds < WATCHDOG_S + 30, result.stderr
    assert result.returncode != 0
    text = result.stderr
    # The launcher's summary shows the report, whichever rank it names (with the fork start method
    # torch's agent names only one failed rank, the lowest of those already gone).
    assert re.search(r"^phalanx: rank \d \(local rank \d on node 0\) failed with exit code 3$", text, re.M), text[
        -3000:
    ]
    summary = text[re.search(r"^phalanx: rank \d \(local", text, re.M).start() :]
    assert summary.count("phalanx watchdog: rank 1 stalled at step 3") == 1
    assert "(timeout 5 s)" in summary  # `phalanx run --watchdog-timeout 5` reached the workers
    assert text.count("phalanx watchdog: rank 1 stalled at step 3 (phase 'step'") == 1, "one report"
    assert "rank 0: step 3, phase 'backward' (waiting)" in summary
    assert "rank 1: step 3, phase 'step'  <-- stalled" in summary
    stacks = summary.split("Python stack of each rank at that moment:")[1]
    rank0, rank1 = stacks.split("--- rank 0 (main thread")[1].split("--- rank 1 (main thread")
    assert "px.backward(" in rank0 and "time.sleep(10**6)" in rank1
    assert "multiprocessing" not in stacks and "launch/worker.py" not in stacks, "launcher frames trimmed"


def test_a_rank_waiting_on_its_data_loader_names_what_each_worker_is_doing():
    """The rank's own stack ends in a queue read; the report adds its child processes: the worker
    that stopped (sleeping where it sleeps) and the one waiting for work."""
    with pytest.raises(RanksFailed) as failed:
        run_ranks("tests.dist.failure_workloads:stuck_loader_worker", 2, args=(WATCHDOG_S,), timeout=120)
    text = str(failed.value)
    stuck = re.search(r"rank 1: worker 0 \(pid (\d+)\) stops delivering", text).group(1)
    assert "phalanx watchdog: rank 1 stalled" in text, text
    rank1 = text.split("--- rank 1 (main thread")[1].split("--- rank ")[0]
    assert "dataloader.py" in rank1, rank1  # its main thread waits on the loader
    workers = re.findall(r"^  pid (\d+): sleeping in \S+, [\d.]+ s CPU in \d+ s; forked from it$", rank1, re.M)
    assert stuck in workers and len(workers) == 2, rank1


def test_a_rank_that_holds_the_interpreter_before_its_first_step_is_not_judged(tmp_path):
    """Issue 52: rank 1 holds the GIL for 5 s after Phalanx() (an extension module's import does),
    its heartbeat thread silent, while rank 0 waits in the first all-reduce: with --watchdog-timeout 2
    it was "rank 1 died (no heartbeat) at step -1 (before its first batch), phase 'start'", exit 3."""
    script = ROOT / "tests/dist/scripts/slow_start.py"
    flags = ["--nproc-per-node", "2", "--watchdog-timeout", "2", "--run-dir", str(tmp_path / "run")]
    result = run_cli(["run", *flags, str(script), "5"], cwd=ROOT, env=SCRIPT_PATH, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: finished" in result.stdout and "rank 1: finished" in result.stdout
    assert "phalanx watchdog" not in result.stderr


def test_rank_that_is_killed_is_named_with_its_step():
    text, seconds = misbehave("kill")
    assert seconds < WATCHDOG_S + 30, text
    assert "(exit -9)" in rank_output(text, 1)
    assert "phalanx watchdog: rank 1 stopped sending heartbeats at step 3" in rank_output(text, 0)


def test_rank_killed_inside_a_save_is_named_in_the_save_phase(tmp_path):
    """Was 'phase 'backward'': the peers read the phase of the last heartbeat, from before the save."""
    with pytest.raises(RanksFailed) as failed:
        run_ranks(
            "tests.dist.failure_workloads:killed_while_saving",
            2,
            args=(str(tmp_path / "ckpt"), WATCHDOG_S),
            timeout=120,
        )
    text = str(failed.value)
    assert "rank 1: killed inside its save" in rank_output(text, 1), text
    assert "phalanx watchdog: rank 1 stopped sending heartbeats at step 3, phase 'save_state'" in rank_output(text, 0)


def test_rank_that_leaves_its_loop_early_is_named():
    text, seconds = misbehave("leave")
    assert seconds < WATCHDOG_S + 30, text
    # it broke out of its loop (as sys.exit would leave): not "its data ran out first", which it did not
    assert (
        "phalanx watchdog: rank 1 exited after step 3 with batches of its prepared loader still unread (a break, "
        "return or sys.exit in the script?)"
    ) in text
    assert "data ran out" not in text and "px.uneven_inputs" in text
    assert "(exit 0)" not in text, "no rank of a stopped job may report success"


def test_collective_timeout_fails_in_its_configured_seconds():
    with pytest.raises(RanksFailed) as failed:
        run_ranks("tests.dist.failure_workloads:collective_timeout", 2, args=(3.0,), timeout=90)
    rank0 = rank_output(str(failed.value), 0)
    seconds = float(re.search(r"barrier failed after ([\d.]+) s", rank0).group(1))
    assert 2.5 < seconds < 15, rank0


def test_every_rank_stuck_in_backward_is_reported_after_the_collective_timeout():
    """No collective timeout covers a comm hook's future: the watchdog's backstop ends the job."""
    start = time.time()
    with pytest.raises(RanksFailed) as failed:
        run_ranks("tests.dist.failure_workloads:comm_hook_never_completes", 2, args=(4.0,), timeout=90)
    text = str(failed.value)
    assert "timed out" not in text.splitlines()[0], text
    assert time.time() - start < 60, text
    assert "phalanx watchdog: every rank has been in phase 'backward' at step 1 for " in text, text
    assert "(collective timeout + watchdog timeout = 6 s)" in text
    assert "rank 1: step 1, phase 'backward'  <-- stuck" in text


@pytest.fixture(scope="module")
def debug_run():
    return run_ranks("tests.dist.failure_workloads:debug_mismatch_and_busy_rank0", 2, timeout=90)


def test_rank0_busy_in_main_process_first_beyond_the_timeout_is_no_stall(debug_run):
    assert debug_run[0]["survived_busy_rank0"] and debug_run[1]["survived_busy_rank0"]


def test_debug_mode_names_each_rank_shape(debug_run):
    r0, r1 = debug_run
    assert r0 == r1
    assert r0["reduce_shape"] == (
        "phalanx debug: the ranks called reduce[mean] with mismatched tensors (shapes and dtypes must match):\n"
        "  rank 0: reduce[mean](shape (4, 3) float32)\n"
        "  rank 1: reduce[mean](shape (5, 3) float32)\n"
        "HINT: every rank must call the same collectives in the same order with tensors of the same "
        "shape and dtype; look for rank-dependent branches or batch sizes before this call."
    )
    assert "rank 0: reduce[mean](shape (4,) float32)" in r0["reduce_dtype"]
    assert "rank 1: reduce[mean](shape (4,) float64)" in r0["reduce_dtype"]
    assert "gather with mismatched tensors (dims after the first must match)" in r0["gather_trailing"]
    assert "rank 1: gather(shape (2, 4) float32)" in r0["gather_trailing"]
    assert "the ranks called different collectives" in r0["different_ops"]
    assert "rank 0: reduce[mean](shape (2,) float32)" in r0["different_ops"]
    assert "rank 1: gather(shape (2,) float32)" in r0["different_ops"]
    assert "rank 0: barrier(no tensors)" in r0["barrier_vs_reduce"]
    assert tuple(r0["gather_ragged_ok"]) == (3, 2)
    assert r0["reduce_ok"] == 1.0
