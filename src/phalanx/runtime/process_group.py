"""Process-group lifetime: init with the right backend and a short timeout, clean teardown."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import signal
import sys
import threading
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from phalanx import refusal
from phalanx.runtime.context import WORLD_OF_ONE_GROUPS, AgentEnv, DistContext

# torch's default collective timeout is 10-30 minutes: a stuck job should fail in minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def collective_timeout(seconds: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> datetime.timedelta:
    if seconds <= 0:
        raise ValueError(f"collective timeout must be positive, got {seconds}")
    return datetime.timedelta(seconds=seconds)


def init_process_group(ctx: DistContext, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> bool:
    """Join the default group when the world has several ranks; True if this call created it.

    A group that exists already (ctx.adopted) is used as it is and never destroyed by phalanx:
    whoever created it owns its lifetime.
    """
    if not ctx.is_distributed and not dist.is_initialized():
        return _join_world_of_one(collective_timeout(timeout_s))
    if not ctx.is_distributed or dist.is_initialized():
        if ctx.adopted and ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        return False
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    kwargs = {}
    if ctx.init_method:  # `srun`/`mpiexec python train.py`: the store address came with the context
        kwargs["init_method"] = ctx.init_method
    if ctx.device.type == "cuda":
        kwargs["device_id"] = ctx.device  # binds NCCL eagerly: no rank-to-GPU guessing later
    timeout = collective_timeout(timeout_s)
    store = None if "init_method" in kwargs else _restart_scoped_store(timeout)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(
        backend=ctx.backend,
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=timeout,
        **kwargs,
    )
    _state["owned"] = True
    _watch_for_uncaught_exceptions()
    atexit.register(destroy_process_group)
    return True


def _join_world_of_one(timeout: datetime.timedelta) -> bool:
    """A world of one gets a default group of its one rank (gloo over an in-process store: no port,
    no peer, about a millisecond), so that what a script asks of torch.distributed itself works as
    under a launcher: `DistributedSampler(ds)` reads the world size and rank from it (plain python
    died with "Default process group has not been initialized"), `dist.all_reduce` sums one rank.
    phalanx's own code still sees a world of one (`collectives.is_distributed()` counts ranks)."""
    if not dist.is_available():
        return False
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    except RuntimeError as error:  # e.g. gloo finds no address for this host: the world of one runs without
        from phalanx.logging.rank_log import get_logger

        get_logger().warning(
            "no process group for this world of one (gloo: %s); torch.distributed calls in the script need "
            "one. HINT: DistributedSampler(ds, num_replicas=1, rank=0), or set GLOO_SOCKET_IFNAME=lo",
            error,
        )
        return False
    _state["owned"] = _state["world_of_one"] = True
    WORLD_OF_ONE_GROUPS[:] = [dist.group.WORLD]
    atexit.register(destroy_process_group)
    return True


def owns_world_of_one() -> bool:
    """Whether the default group is the one phalanx made for a world of one (tests end it between cases)."""
    return bool(_state["world_of_one"] and _state["owned"] and dist.is_initialized())


def _restart_scoped_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The elastic agent's store, with keys scoped to this restart (None when not under the agent).

    Workers of every restart share the agent's TCPStore, and the keys the previous attempt wrote
    (each rank's gloo address) are still there: a restarted rank could read a dead peer's address
    and fail with "connection refused" or hang. A prefix per attempt gives each attempt clean keys;
    the attempt's name is the one all nodes agreed on (a node that joined later counts its own
    restarts from 0).
    """
    agent = AgentEnv.from_env()
    if not agent.uses_agent_store:
        return None
    store = dist.TCPStore(agent.master_addr, agent.master_port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"phalanx/restart_{agent.attempt}", store)


def store_client(timeout: datetime.timedelta) -> dist.Store:
    """A connection of this thread's own to the job's store, unprefixed: the elastic agent's store
    where there is one (the launcher reads it too), else a clone of the default group's."""
    agent = AgentEnv.from_env()
    if agent.uses_agent_store:
        return dist.TCPStore(agent.master_addr, agent.master_port, is_master=False, timeout=timeout)
    return dist.distributed_c10d._get_default_store().clone()  # noqa: SLF001


_state = {"failed": False, "owned": False, "world_of_one": False}  # owned: phalanx created the default group


def _watch_for_uncaught_exceptions() -> None:
    previous = sys.excepthook

    def hook(*exc_info):
        _state["failed"] = True
        if isinstance(exc_info[1], refusal.Refused):  # the same on every rank: rank 0 says it, no tracebacks
            refusal.say(exc_info[1], dist.get_rank() if dist.is_initialized() else 0, launcher=False)
            return
        previous(*exc_info)

    sys.excepthook = hook


@contextlib.contextmanager
def ignoring_sigint() -> Iterator[None]:
    """Ctrl-C reaches every rank twice (from the terminal, then forwarded by the launcher's agent
    as it shuts the workers down): the second must not interrupt the exit path half-way, which
    ends in a KeyboardInterrupt traceback from an atexit handler. A rank stuck here is still ended
    by the agent (SIGTERM, then SIGKILL)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def leaving_cleanly() -> bool:
    """No exception on its way out, or `sys.exit(0)`: forked workers run the exit handlers inside
    the `finally` the SystemExit passes through, and exit 0 there is a clean end, not a failure."""
    error = sys.exc_info()[1]
    return error is None or (isinstance(error, SystemExit) and error.code in (0, None))


def destroy_process_group(before_destroy: Callable[[], None] | None = None) -> None:
    """Leave the group at exit.

    After a clean run, a barrier first: without it gloo occasionally aborts at exit
    (TORCH-CPU-FACTS). After an uncaught exception, no barrier: the peers are still inside
    their own collectives and waiting for them would only delay the failure report.
    A group phalanx did not create (adopted) is left to its creator. `before_destroy` runs between
    the two (the watchdog stops its thread there: see `Watchdog.leave`).
    """
    if not dist.is_initialized() or not _state["owned"]:
        if before_destroy is not None:
            before_destroy()
        return
    _state["owned"] = _state["world_of_one"] = False
    WORLD_OF_ONE_GROUPS.clear()
    # An exception on its way out counts too: forked workers (`phalanx run`) run the atexit
    # handlers from a `finally`, and sys.excepthook is never called there.
    with ignoring_sigint():
        if not _state["failed"] and leaving_cleanly():
            dist.barrier()
        if before_destroy is not None:
            before_destroy()
        dist.destroy_process_group()
