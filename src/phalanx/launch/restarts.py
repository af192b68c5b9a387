"""What the launcher says while torch's elastic agent supervises the workers: restarts and failures.

torch's `LocalElasticAgent` polls its workers (`_monitor_workers`) and, on a failure with restarts
left, restarts the whole group (`_restart_workers`). `observing_agent` subclasses it to hook both
points, with no process management of its own:

- when a poll finds failed ranks, it reads each one's step from the store (the watchdog's records,
  `phalanx.store_keys`) before the workers are stopped;
- before each automatic restart it prints one line: attempt k of N, which rank died and how, and
  the checkpoint step the group resumes from (or "from the start");
- after each rendezvous (`_rendezvous`) the nodes agree on the attempt's name for their workers, and
  when the group shrank or grew (an elastic range losing or regaining a node) it says so with the
  old and new number of processes (see membership.py).

`torch.distributed.launcher.api.launch_agent` builds its agent from the module-level name
`LocalElasticAgent`; `agent_class_installed` points that name at the subclass for one launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from phalanx import envvars, refusal, store_keys
from phalanx.launch import etcd_store, exit_times, membership


@dataclass
class Observations:
    """What the agent saw, for the final report: each failed rank's progress, from the store."""

    progress: dict[int, store_keys.RankProgress] = field(default_factory=dict)
    restarts: list[str] = field(default_factory=list)  # the lines printed, in order
    ended_at: dict[int, float] = field(default_factory=dict)  # unix time each rank's process ended (exit_times.py)


def describe_exit(exitcode: int, signal_name: str | None = None) -> str:
    """'exit code 3' / 'killed by signal SIGKILL' for a worker's raw exit code."""
    if exitcode < 0:
        return f"killed by signal {signal_name or -exitcode}"
    return f"exit code {exitcode}"


def resume_point(checkpoint_dir: str | None) -> str:
    """'from checkpoint step 40 (DIR/step-00000040)', or 'from the start' when there is none.

    The newest published checkpoint whose manifest lists files that are all present at their
    recorded size; the workers verify checksums when they load, and say so if it is damaged.
    """
    if not checkpoint_dir:
        return "from the start (no --checkpoint-dir)"
    from phalanx.checkpoint import atomic
    from phalanx.checkpoint.object_path import location

    found = atomic.latest_intact(location(checkpoint_dir))
    if found is None:
        return f"from the start (no checkpoint in {checkpoint_dir} yet)"
    return f"from checkpoint step {found[0]} ({found[1]})"


def restart_line(
    attempt: int,
    max_restarts: int,
    failures: dict[int, Any],
    progress: dict[int, store_keys.RankProgress],
    resume: str,
    ended_at: dict[int, float] | None = None,
) -> str:
    """`phalanx: restart 1 of 2: rank 1 was killed by signal SIGKILL at step 7; resuming from ...`."""
    first = first_failures_first(failures, progress, ended_at)
    parts = []
    for rank, failure in first:
        how = describe_exit(failure.exitcode, failure.signal_name() if failure.exitcode < 0 else None)
        step = progress.get(rank, store_keys.RankProgress()).step
        where = f" at step {step} of that attempt" if step is not None and step >= 0 else ""
        parts.append(f"rank {rank} {'was ' if failure.exitcode < 0 else 'ended with '}{how}{where}")
    return f"phalanx: restart {attempt} of {max_restarts}: {', then '.join(parts)}; resuming {resume}"


STORAGE_FAULT = "CheckpointWriteError: "  # how torch's error file names checkpoint/save_attempt.py's error


def storage_fault(failures: dict[int, Any]) -> bool:
    """A rank failed because a checkpoint could not be written: restarting would only fail again."""
    for failure in failures.values():
        message = failure.error_file_data.get("message") if failure.error_file_data else None
        text = message.get("message", "") if isinstance(message, dict) else str(message or "")
        if text.startswith(STORAGE_FAULT):
            return True
    return False


def refused(failures: dict[int, Any]) -> str | None:
    """What prepare refused, as a failed worker recorded it (phalanx/refusal.py); None otherwise."""
    for failure in failures.values():
        found = refusal.from_error_file_data(failure.error_file_data)
        if found is not None:
            return found
    return None


def failure_order(rank: int, failure: Any, progress: dict[int, store_keys.RankProgress]) -> tuple:
    """Sort key without the processes' end times: torch's failure timestamp (whole seconds), then the
    watchdog's sub-second failure time when a rank recorded one, then the rank (only to make equal
    keys deterministic)."""
    failed_at = progress.get(rank, store_keys.RankProgress()).failed_at
    return (failure.timestamp, failed_at if failed_at is not None else float("inf"), rank)


def first_failures_first(
    failures: dict[int, Any],
    progress: dict[int, store_keys.RankProgress],
    ended_at: dict[int, float] | None = None,
) -> list[tuple[int, Any]]:
    """Failures, the first one first: by the moment each rank's process ended, when the agent saw
    every one of them end (launch/exit_times.py: a cause ends before its consequences and before
    the ranks the agent stops), else by `failure_order`."""
    ended_at = ended_at or {}
    if failures and all(rank in ended_at for rank in failures):
        return sorted(failures.items(), key=lambda item: (ended_at[item[0]], item[0]))
    return sorted(failures.items(), key=lambda item: failure_order(item[0], item[1], progress))


def read_progress(store: Any, restart: int, ranks: list[int]) -> dict[int, store_keys.RankProgress]:
    """Each rank's record and failure note from the agent's store; missing keys are skipped."""
    base = store
    while hasattr(base, "underlying_store"):  # the agent sees the rendezvous' PrefixStore
        base = base.underlying_store
    found = {}
    for rank in ranks:
        record_key, failed_key = store_keys.record_key(restart, rank), store_keys.failed_key(restart, rank)
        try:
            record = base.get(record_key) if base.check([record_key]) else None
            failed = base.get(failed_key) if base.check([failed_key]) else None
        except Exception:  # noqa: BLE001 - the step is a detail of the report, never a reason to fail it
            continue
        found[rank] = store_keys.parse(record, failed)
    return found


@dataclasses.dataclass
class _AgentSetup:
    checkpoint_dir: str | None
    seen: Observations
    say: Callable[[str], None]
    stopper: Any
    node_name: str


def observing_agent(
    base: type,
    checkpoint_dir: str | None,
    seen: Observations,
    say: Callable[[str], None] | None = None,
    stopper: Any = None,
    node_name: str = "",
) -> type:
    """A subclass of torch's LocalElasticAgent (`base`) that records failures and speaks restarts;
    `node_name` is how this node is named when it leaves or joins (its address across nodes).

    With a `stopper` (launch/preemption.py) it also lets preempted workers finish their checkpoint
    and never restarts a preempted group."""
    setup = _AgentSetup(
        checkpoint_dir,
        seen,
        say or (lambda line: print(line, file=sys.stderr, flush=True)),
        stopper,
        node_name or socket.gethostname(),
    )
    return type("PhalanxAgent", (_ObservingAgent, base), {"_phalanx": setup})


class _ObservingAgent:
    """The methods the observing agent puts over torch's LocalElasticAgent (its subclass is made by
    `observing_agent`, which sets `_phalanx`: what the methods observe with)."""

    _phalanx: "_AgentSetup"

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        if self._phalanx.stopper is not None:
            self._phalanx.stopper.agent = self
        outage = etcd_store.outage_of(self._worker_group.spec.rdzv_handler)
        if outage is not None:
            outage.say = self._phalanx.say
            if self._phalanx.stopper is not None:  # the store gone for good: stop with a checkpoint, as a preemption

                def stop(line: str) -> None:
                    self._phalanx.say(line)
                    self._phalanx.stopper.stop_for(outage.stop_reason())

                outage.on_lost = stop

    def _exit_barrier(self):  # type: ignore[no-untyped-def]
        outage = etcd_store.outage_of(self._worker_group.spec.rdzv_handler)
        if outage is not None and outage.since is not None:
            return  # the barrier lives in the store that is away: waiting on it would only time out
        super()._exit_barrier()

    _phalanx_attempt: str | None = None  # the name of the running attempt, agreed by the nodes
    _phalanx_members: membership.Membership | None = None

    def _rendezvous(self, worker_group):  # type: ignore[no-untyped-def]
        super()._rendezvous(worker_group)
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        has_rounds = isinstance(spec.rdzv_handler, DynamicRendezvousHandler)
        self._phalanx_attempt = membership.agree_attempt(worker_group.store, restart_count, has_rounds)
        membership.export_attempt(self._phalanx_attempt)
        nodes = (
            membership.exchange_nodes(
                worker_group.store, worker_group.group_rank, worker_group.group_world_size, self._phalanx.node_name
            )
            if has_rounds
            else None
        )
        now = membership.Membership(worker_group.workers[0].world_size, nodes or ())
        before = self._phalanx_members
        if before is not None:
            if not (before.nodes and now.nodes):  # names unknown on one side: compare the sizes only
                before = membership.Membership(before.world_size, now.nodes)
            line = membership.resize_line(before, now)
            if line:
                self._phalanx.seen.restarts.append(line)
                self._phalanx.say(line)
        self._phalanx_members = now

    def _monitor_workers(self, worker_group):  # type: ignore[no-untyped-def]
        if self._phalanx.stopper is not None:
            self._phalanx.stopper.wait_for_workers(worker_group.spec.monitor_interval)
            if self._remaining_restarts > 0:
                self._phalanx.stopper.end_group_for_restart(before_kill=self._phalanx_stopping)
        result = super()._monitor_workers(worker_group)
        if result.is_failed() or result.state.name == "SUCCEEDED":
            self._phalanx_ended(worker_group, result)
        if result.is_failed() and worker_group.store is not None:
            restart = self._phalanx_attempt or worker_group.spec.max_restarts - self._remaining_restarts
            self._phalanx.seen.progress = read_progress(worker_group.store, restart, sorted(result.failures))
            self._phalanx_failures = result.failures
        if (
            result.is_failed()
            and self._phalanx.stopper is not None
            and self._phalanx.stopper.takes_over(result.failures)
        ):
            self._remaining_restarts = 0  # preempted: the job ends here, it is not restarted
        if result.is_failed() and self._remaining_restarts > 0 and refused(result.failures) is not None:
            self._remaining_restarts = 0  # the layout cannot take the model: every attempt would refuse it
        if result.is_failed() and self._remaining_restarts > 0 and storage_fault(result.failures):
            self._remaining_restarts = 0
            self._phalanx.say(
                "phalanx: not restarting: a checkpoint could not be written (see below); make room or fix the "
                "storage, then run the same command to resume from the latest good checkpoint"
            )
        return result

    _phalanx_exits: exit_times.ExitTimes | None = None

    def _start_workers(self, worker_group):  # type: ignore[no-untyped-def]
        pids = super()._start_workers(worker_group)
        if self._phalanx_exits is not None:
            self._phalanx_exits.stop()
        self._phalanx_exits = exit_times.ExitTimes(dict(pids))
        self._phalanx_exits.watch_stopping(self._pcontext)
        if self._phalanx.stopper is not None:
            self._phalanx.stopper.started_at = time.time()
        return pids

    def _phalanx_stopping(self) -> None:
        if self._phalanx_exits is not None:
            self._phalanx_exits.stopping()

    def _phalanx_ended(self, worker_group, result) -> None:  # type: ignore[no-untyped-def]
        """The workers are done: when each ended, and under fork every failed rank, not one."""
        exits, self._phalanx_exits = self._phalanx_exits, None
        if exits is not None:
            exits.stop()
        if not result.is_failed():
            return
        if exits is not None:
            global_ranks = [worker.global_rank for worker in worker_group.workers]
            exit_times.own_failures(result.failures, self._pcontext, global_ranks, exits)
            self._phalanx.seen.ended_at = {global_ranks[local]: at for local, at in exits.at.items()}

    def _restart_workers(self, worker_group):  # type: ignore[no-untyped-def]
        failures = getattr(self, "_phalanx_failures", None)
        if failures:  # a failure, not a membership change (new nodes joining)
            spec = worker_group.spec
            attempt = spec.max_restarts - self._remaining_restarts
            resume = resume_point(self._phalanx.checkpoint_dir)
            line = restart_line(
                attempt, spec.max_restarts, failures, self._phalanx.seen.progress, resume, self._phalanx.seen.ended_at
            )
            self._phalanx.seen.restarts.append(line)
            self._phalanx.say(line)
            self._phalanx_failures = None
        return super()._restart_workers(worker_group)


@contextlib.contextmanager
def agent_class_installed(
    checkpoint_dir: str | None, seen: Observations, stopper: Any = None, node_name: str = ""
) -> Iterator[None]:
    """Make torch's `launch_agent` build the observing agent, for the duration of the block (which
    also ends the attempt name it exports to workers)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    exported = os.environ.get(envvars.PHALANX_ATTEMPT)
    api.LocalElasticAgent = observing_agent(original, checkpoint_dir, seen, stopper=stopper, node_name=node_name)
    try:
        yield
    finally:
        api.LocalElasticAgent = original
        if exported is None:
            os.environ.pop(envvars.PHALANX_ATTEMPT, None)
        else:
            os.environ[envvars.PHALANX_ATTEMPT] = exported
