"""etcd as the rendezvous store (`--rdzv-backend etcd-v2` / `etcd`): refused before launch when it
does not answer, and outlived mid-job for a bounded, named wait.

Before launch: torch connects to etcd only inside its agent, and a missing etcd ended in a
116-line traceback ("RendezvousConnectionError"). `check_reachable` connects once, within a few
seconds, and `phalanx run` refuses with the endpoint and the fix before any worker starts.

Mid-job: torch's agent asks its rendezvous handler `num_nodes_waiting()` at every poll of healthy
workers; with etcd gone that raises and the agent, with its workers, ends within a second, whatever
`--max-restarts` says. Running workers need no rendezvous (their own store is the workers' TCPStore);
only a new round does (a restart, a node joining). `tolerate_outage` wraps the handler torch built:
while etcd does not answer it says so once, counts no node waiting (no round could be held anyway)
and asks again at most once a second; when etcd answers again it says so; after `wait_s`
(`--rdzv-timeout`) it calls `outage.on_lost`, which the agent points at a stop with a checkpoint
(restarts.py, preemption.py). The agent and its process management stay torch's own.
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from phalanx.launch.rendezvous import split_endpoint

ETCD_BACKENDS = ("etcd", "etcd-v2")
ETCD_DEFAULT_PORT = 2379  # torch's default for an etcd endpoint without a port
PROBE_TIMEOUT_S = 5.0
RETRY_EVERY_S = 1.0
OUTAGE_CONFIG_KEY = "phalanx_store_outage_s"  # in rdzv_configs: how long the store may be away mid-job


def address(endpoint: str) -> tuple[str, int]:
    host, port = split_endpoint(endpoint or "localhost")
    return host or "localhost", port or ETCD_DEFAULT_PORT


def check_reachable(backend: str, endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when something listens at the etcd endpoint; else the refusal, with the fix."""
    host, port = address(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as error:
        why = error.strerror or type(error).__name__
        if isinstance(error, socket.timeout):
            why = f"no answer within {timeout_s:g} s"
    return (
        f"the rendezvous store (etcd, --rdzv-backend {backend}) at {host}:{port} does not answer: {why}. "
        f"HINT: start etcd there first (etcd --enable-v2 --listen-client-urls http://{host}:{port} "
        f"--advertise-client-urls http://{host}:{port}), or correct --rdzv-endpoint"
    )


def _store_errors() -> tuple[type[BaseException], ...]:
    """What a rendezvous handler raises when its store does not answer (torch's, python-etcd's)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    errors: list[type[BaseException]] = [RendezvousError, OSError]
    try:
        import etcd  # python-etcd, the client of torch's older etcd rendezvous

        errors.append(etcd.EtcdException)
    except ImportError:
        pass
    return tuple(errors)


@dataclass
class Outage:
    """How long the store has been away; `on_lost` is called once when that passes `wait_s`."""

    where: str  # "etcd at HOST:PORT"
    wait_s: float
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    on_lost: Callable[[str], None] | None = None
    since: float | None = None
    last_try: float = 0.0
    lost: bool = False
    outages: list[float] = field(default_factory=list)  # seconds of each outage the job outlived

    def lost_line(self) -> str:
        return (
            f"phalanx: the rendezvous store ({self.where}) has not answered for {self.wait_s:g} s "
            f"(--rdzv-timeout): stopping the workers with a checkpoint. HINT: bring etcd back at "
            f"{self.where.split(' at ')[-1]}, then run the same command to resume"
        )

    def stop_reason(self) -> str:
        return f"the rendezvous store {self.where} did not answer for {self.wait_s:g} s"

    def failed(self, error: BaseException, now: float) -> None:
        if self.since is None:
            self.since = now
            cause = str(error).splitlines()[0] if str(error) else ""
            self.say(
                f"phalanx: the rendezvous store ({self.where}) does not answer ({type(error).__name__}: {cause}); "
                f"the workers go on, and phalanx waits up to {self.wait_s:g} s (--rdzv-timeout) for it to come "
                "back before stopping them with a checkpoint"
            )
        if not self.lost and now - self.since >= self.wait_s:
            self.lost = True
            if self.on_lost is None:
                raise RendezvousStoreLost(self.lost_line())
            self.on_lost(self.lost_line())

    def answered(self, now: float) -> None:
        if self.since is not None and not self.lost:
            self.outages.append(now - self.since)
            self.say(
                f"phalanx: the rendezvous store ({self.where}) answers again after {now - self.since:.1f} s; "
                "the workers went on"
            )
        self.since = None


class RendezvousStoreLost(RuntimeError):
    """The rendezvous store did not come back within --rdzv-timeout, and no preemption stop was set up."""


def tolerate_outage(handler: Any, endpoint: str, wait_s: float) -> Any:
    """`handler` (torch's etcd rendezvous handler) with a `num_nodes_waiting` that outlives a store
    outage of up to `wait_s`; `handler.phalanx_outage` holds its state."""
    host, port = address(endpoint)
    outage = Outage(f"etcd at {host}:{port}", wait_s)
    errors = _store_errors()
    ask = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        now = time.monotonic()
        if outage.since is not None and (outage.lost or now - outage.last_try < RETRY_EVERY_S):
            return 0
        outage.last_try = now
        try:
            waiting = ask()
        except errors as error:
            outage.failed(error, time.monotonic())
            return 0
        outage.answered(time.monotonic())
        return waiting

    handler.num_nodes_waiting = num_nodes_waiting
    handler.phalanx_outage = outage
    return handler


def outage_of(handler: Any) -> Outage | None:
    return getattr(handler, "phalanx_outage", None)
