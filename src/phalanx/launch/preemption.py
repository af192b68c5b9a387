"""`phalanx run`'s side of preemption: pass the signal on, give the workers time to save, say how
it ended and exit 128 + the signal number (agent.py also requeues a SLURM job then).

torch's agent turns SIGTERM into an exception that stops the workers (SIGTERM, then SIGKILL after
its shutdown timeout) and knows nothing of SIGUSR1, whose default action would end the launcher
and orphan the workers. So the preemption signals are taken out of torch's list; `Stopper`
handles them instead:
- 1st: forward the signal to every local worker and keep supervising; the workers finish their
  step, agree on it, save it and exit (preemption/worker.py). Until they all have exited (or
  `preempt_grace` has passed: then they are killed) no worker is stopped by torch, so a rank that
  exits first never cuts another's save short, and no restart follows.
- 2nd: a note; the save goes on.
- 3rd: the workers are killed at once (SIGKILL); the previous checkpoint stays the latest.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from phalanx import envvars
from phalanx import preemption_report as report
from phalanx.launch import worker_notes
from phalanx.launch.exit_times import worker_states

NO_CHECKPOINT_DIR = (
    "no checkpoint_dir is set. HINT: with --checkpoint-dir DIR (or checkpoint_dir: in the config) "
    "the workers save the step they stop at, and the same command resumes from it"
)


def without_signals(signals_to_handle: str, taken: tuple[signal.Signals, ...]) -> str:
    """torch's comma-separated signal list minus the ones phalanx handles itself."""
    names = {s.name for s in taken}
    return ",".join(n for n in (x.strip() for x in signals_to_handle.split(",")) if n and n not in names)


@dataclass
class Stopper:
    """The launcher's preemption state; `agent` is torch's agent, set once it exists."""

    signals: tuple[signal.Signals, ...]
    grace: float
    checkpoint_dir: str | None = None
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    agent: Any = None
    signal: signal.Signals | None = None
    count: int = 0
    deadline: float | None = None
    killed_after_grace: bool = False
    killed_by_third: bool = False
    before_workers: bool = False
    workers: int = 0  # the workers alive when the first signal came
    running: list[int] = field(default_factory=list)  # their global ranks
    signalled_at: float | None = None  # unix time of the first signal
    started_at: float | None = None  # unix time the agent started the current workers (restarts.py)
    outcome: report.PreemptionOutcome | None = None  # what the workers recorded
    reason: str | None = None  # why the launcher itself stopped the workers (stop_for)
    _previous: dict[signal.Signals, Any] = field(default_factory=dict)

    # ---- signals ---------------------------------------------------------------------------------
    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _installed.append(self)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self in _installed:
            _installed.remove(self)

    def _handle(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        self.count += 1
        if self.count == 1:
            if not self._stop(sig):  # no workers (yet): nothing to save, stop as torch would
                raise SignalException(f"phalanx run got {sig.name} before its workers started", sig)
        elif self.count == 2:
            self.say(
                f"phalanx: {sig.name} again: the workers are still finishing their step and checkpoint; "
                "a third signal stops them at once"
            )
        else:
            self.killed_by_third = True
            self.kill_workers()
            raise SignalException(f"phalanx run got a third {sig.name}", sig)

    def _stop(self, sig: signal.Signals) -> bool:
        """The first signal: pass it to every worker, which saves its agreed step; False without workers."""
        self.signal, self.deadline = sig, time.monotonic() + self.grace
        self.signalled_at = time.time()
        pids = self._live_pids()
        if not pids:
            self.before_workers = True
            return False
        self.workers = len(pids)
        group = getattr(self.agent, "_worker_group", None)
        self.running = sorted(w.global_rank for w in getattr(group, "workers", ()) if w.id in pids)
        for pid in pids:
            _send(pid, sig)
        return True

    def stop_for(self, reason: str) -> None:
        """The launcher's own stop (the rendezvous store gone for good, etcd_store.py): as a first
        preemption signal, the workers save their agreed step and exit; the final line names `reason`."""
        if self.count == 0:
            self.count, self.reason = 1, reason
            self._stop(self.signals[0])

    def _live_pids(self) -> list[int]:
        return [pid for pid, code in worker_states(getattr(self.agent, "_pcontext", None)) if code is None]

    def kill_workers(self) -> None:
        for pid in self._live_pids():
            _send(pid, signal.SIGKILL)

    # ---- while the workers save ------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.signal is not None

    def wait_for_workers(self, interval: float) -> None:
        """Called before each poll of torch's agent: while stopping, wait here until every worker
        has exited (torch would stop the rest as soon as one exits), killing them after the grace."""
        while self.active and self._live_pids():
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.killed_after_grace = True
                self.kill_workers()
            time.sleep(interval)

    def end_group_for_restart(self, before_kill: Callable[[], None] = lambda: None) -> None:
        """A worker failed and a restart follows: kill the others now (`before_kill` first). torch
        would send them SIGTERM and wait up to 30 s, but a worker that saves on SIGTERM only leaves
        once its own collective has failed; the restart does not need what they would still do."""
        states = worker_states(getattr(self.agent, "_pcontext", None))
        preempted = {128 + int(s) for s in self.signals}
        if not self.active and any(code not in (None, 0) and code not in preempted for _, code in states):
            before_kill()
            self.kill_workers()

    def takes_over(self, failures: dict[int, Any]) -> bool:
        """After a failed poll: True when this is a preemption (no restart must follow)."""
        for failure in failures.values():
            found = report.from_error_file_data(failure.error_file_data)
            if found is not None:
                self.outcome = self.outcome or found
        return self.active or self.outcome is not None

    # ---- the end ----------------------------------------------------------------------------------
    def final(self) -> report.PreemptionOutcome:
        """How the preemption ended: what the workers recorded, else what the launcher saw."""
        outcome = self.outcome or self._launcher_outcome()
        if self.reason and not outcome.reason:
            outcome = dataclasses.replace(outcome, reason=self.reason)
        return outcome

    def _launcher_outcome(self) -> report.PreemptionOutcome:
        assert self.signal is not None
        if self._script_finished():
            return report.PreemptionOutcome(self.signal.name, finished=True)
        if self.before_workers:
            why = "it came before the workers had started"
        elif not self._phalanx_created():
            return report.PreemptionOutcome(self.signal.name, running=self._what_ran())
        elif not self.checkpoint_dir:
            why = NO_CHECKPOINT_DIR
        elif self.killed_by_third:
            why = f"a third {self.signal.name} stopped the workers at once; {_latest(self.checkpoint_dir)}"
        elif self.killed_after_grace:
            why = (
                f"the workers had not finished their step and checkpoint after preempt_grace ({self.grace:.0f} s) "
                f"and were killed; {_latest(self.checkpoint_dir)}"
            )
        else:
            why = f"the workers ended without saving (see above); {_latest(self.checkpoint_dir)}"
        return report.PreemptionOutcome(self.signal.name, why_not=why)

    def _script_finished(self) -> bool:
        """Whether every worker alive at the signal had returned from the script: each leaves its
        final note for the launcher then (launch/worker_notes.py), before the interpreter's exit; the
        note a worker leaves while it runs (after joining its group) says it had not finished."""
        finished = [note for note in self._notes() if note.finished]
        return bool(self.workers and len(finished) >= self.workers)

    def _notes(self) -> list[worker_notes.WorkerNote]:
        notes_dir = os.environ.get(envvars.PHALANX_WORKER_NOTES)
        return worker_notes.read(notes_dir) if notes_dir else []

    def _phalanx_created(self) -> bool:
        """Whether a process of the job created Phalanx() (whose ranks save their step on the signal);
        True when the launcher cannot tell (no notes directory)."""
        notes_dir = os.environ.get(envvars.PHALANX_WORKER_NOTES)
        return not notes_dir or worker_notes.phalanx_created(notes_dir)

    def _what_ran(self) -> str:
        """'while training: ranks 0, 1 were running the script at 08:01:02 UTC, 12.3 s after they
        started' for the stop line of a script without Phalanx() (training: they had joined a group)."""
        joined = any(note.group_size for note in self._notes())
        ranks = self.running or list(range(self.workers))
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        at = self.signalled_at or time.time()
        when = time.strftime("%H:%M:%S UTC", time.gmtime(at))
        since = f", {at - self.started_at:.1f} s after they started" if self.started_at is not None else ""
        if not joined:  # no worker had said it joined its group (a few seconds after it does)
            return f"while the script was starting on {who} ({when}{since})"
        return f"while training: {who} {'were' if len(ranks) > 1 else 'was'} running the script at {when}{since}"


_installed: list[Stopper] = []


def _in_forked_child() -> None:
    """A worker forked from the launcher gets the interpreter's default handlers back, not the
    launcher's (which would send signals to the launcher's idea of its workers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for stopper in _installed:
        for sig, handler in stopper._previous.items():  # noqa: SLF001 - this module's own object
            signal.signal(sig, handler)
        stopper._previous.clear()  # noqa: SLF001
    _installed.clear()


os.register_at_fork(after_in_child=_in_forked_child)


def _latest(checkpoint_dir: str) -> str:
    from phalanx.checkpoint import atomic
    from phalanx.checkpoint.object_path import location

    return atomic.describe_latest(location(checkpoint_dir))


def _send(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # exited meanwhile
