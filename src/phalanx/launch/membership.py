"""Who is in the worker group after each rendezvous, said by the launcher when it changes.

With an elastic range (`--nnodes 1:2`, c10d), torch's agent restarts the worker group on a smaller
world when a node is lost (its workers fail, the survivors re-rendezvous with the nodes left) and on
a larger one when a node comes back (the waiting node triggers a restart). Two things follow:

- the launcher says it, with the old and new number of processes and the nodes that left or joined:
  `phalanx: restarting with 2 processes (was 4) after node 10.0.0.2 left`;
- every node must name the new attempt alike. torch's TORCHELASTIC_RESTART_COUNT is each agent's own
  count (a node that joins later starts from 0), so the workers' store keys scoped by it would not
  meet. After each rendezvous the agents agree on one name in the round's own store (the first one
  written wins) and hand it to their workers as PHALANX_ATTEMPT.

Each agent writes its node's name in the round's store and reads the others'; that is all the
traffic (a few keys per restart). Only `set`, `get` and `add` are used: the etcd rendezvous's store
(`--rdzv-backend etcd-v2`) has no compare_set or multi_get.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from phalanx import envvars

ATTEMPT_KEY = "phalanx/attempt"
PROPOSALS_KEY = "phalanx/attempt-proposals"
NODE_KEY = "phalanx/node/{}"


@dataclass(frozen=True)
class Membership:
    """The worker group one rendezvous formed: how many processes, on which nodes (by group rank)."""

    world_size: int
    nodes: tuple[str, ...]


def agree_attempt(round_store: Any, restart_count: int, has_rounds: bool) -> str:
    """One name for this attempt on every node.

    A rendezvous with rounds (c10d) gives each round a fresh store prefix: the first agent's
    proposal wins there. A static rendezvous keeps one store, and its nodes restart together
    (they have no other way to), so its restart count is already common to all.
    """
    if not has_rounds:
        return str(restart_count)
    if round_store.add(PROPOSALS_KEY, 1) == 1:  # the first agent here names the attempt
        round_store.set(ATTEMPT_KEY, f"{restart_count}-{uuid.uuid4().hex[:8]}")
    return round_store.get(ATTEMPT_KEY).decode()  # waits for the first agent's set


def exchange_nodes(round_store: Any, group_rank: int, group_world_size: int, name: str) -> tuple[str, ...] | None:
    """Publish this node's name and read every node's, in group-rank order; None if that fails
    (the names only decorate a message: a failure is logged, never fatal)."""
    try:
        round_store.set(NODE_KEY.format(group_rank), name)
        keys = [NODE_KEY.format(rank) for rank in range(group_world_size)]
        return tuple(round_store.get(key).decode() for key in keys)
    except Exception as error:  # noqa: BLE001 - logged; the restart goes on without the node names
        logging.getLogger(__name__).warning(
            "phalanx: could not exchange node names after the rendezvous: %s: %s", type(error).__name__, error
        )
        return None


def export_attempt(attempt: str) -> None:
    """Hand the attempt's name to the workers started next (they inherit this process's environment)."""
    os.environ[envvars.PHALANX_ATTEMPT] = attempt


def resize_line(before: Membership, after: Membership) -> str | None:
    """`phalanx: restarting with 2 processes (was 4) after node B left`, or None when nothing changed."""
    left = [n for n in before.nodes if n not in after.nodes]
    joined = [n for n in after.nodes if n not in before.nodes]
    if before.world_size == after.world_size and not left and not joined:
        return None
    head = f"phalanx: restarting with {_processes(after.world_size)} (was {before.world_size})"
    if left and not joined:
        return f"{head} after {_nodes(left)} left"
    changes = [f"{_nodes(joined)} joined"] * bool(joined) + [f"{_nodes(left)} left"] * bool(left)
    return f"{head}: {', '.join(changes)}" if changes else head


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _nodes(names: list[str]) -> str:
    return f"node {names[0]}" if len(names) == 1 else f"nodes {', '.join(names)}"
