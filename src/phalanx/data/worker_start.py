"""`iter(loader)` with every forked worker seen to start: a worker stuck in its fork is replaced.

CPython before 3.11.10 (gh-112275, fixed in 3.11.10 and 3.12) can fork a child that deadlocks before it
runs any Python: the fork copies the interpreter's thread-state lock while another thread holds it,
and the child waits on that copy forever. A rank process always has such threads: gloo's work loop
(and NCCL's watchdog) take the lock whenever they free the last C++ reference to a tensor a
collective used, which is right after each collective. A DataLoader worker forked at that instant
never starts; its rank waits for its batch forever and the other ranks wait for that rank. Measured
on 2 gloo ranks, an all-gather before each `iter()` of a loader with 2 workers: 1 pass in 400 stuck.

On those Pythons, `start_workers` installs a `worker_init_fn` that marks a shared flag before the
user's own; a worker not marked within START_TIMEOUT_S of its fork is killed with its iterator, the
random state the pass drew from is put back, and the pass starts again, with a warning that names the
worker and the fix. Elsewhere, and when workers are not forked, it is plain `iter(loader)`.
"""

from __future__ import annotations

import multiprocessing
import random
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader


def fork_can_hang(
    version: tuple[int, ...] = tuple(sys.version_info[:3]), implementation: str = sys.implementation.name
) -> bool:
    """Whether this Python's fork can leave a child waiting on a lock copied held (CPython < 3.11.10)."""
    return implementation == "cpython" and tuple(version[:3]) < (3, 11, 10)


FORK_CAN_HANG = fork_can_hang()
START_TIMEOUT_S = 10.0  # a healthy worker marks its flag within milliseconds of its fork
ATTEMPTS = 3


class MarkStarted:
    """A worker's first act: set its flag, then run the user's worker_init_fn (if any)."""

    def __init__(self, flags: Any, inner: Callable[[int], None] | None) -> None:
        self.flags, self.inner = flags, inner

    def __call__(self, worker_id: int) -> None:
        self.flags[worker_id] = 1
        if self.inner is not None:
            self.inner(worker_id)


def forks_workers(loader: DataLoader) -> bool:
    """Whether `iter(loader)` may fork worker processes (persistent workers fork at the first only)."""
    if loader.num_workers <= 0:
        return False
    context = loader.multiprocessing_context
    if context is not None:
        method = context.get_start_method()
    else:  # the process default, read without fixing it (a later set_start_method must still work)
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return method == "fork"


def start_workers(loader: DataLoader, who: str = "this rank", timeout: float | None = None) -> Iterator[Any]:
    """`iter(loader)`; on a CPython that can hang a fork, each new worker is seen to start first."""
    if not (FORK_CAN_HANG and forks_workers(loader)):
        return iter(loader)
    timeout = START_TIMEOUT_S if timeout is None else timeout
    drawn = _random_state(loader)
    for attempt in range(1, ATTEMPTS + 1):
        before = getattr(loader, "_iterator", None)
        flags = multiprocessing.RawArray("b", loader.num_workers)
        inner = loader.worker_init_fn
        loader.worker_init_fn = MarkStarted(flags, inner)
        try:
            it = iter(loader)
        finally:
            loader.worker_init_fn = inner
        workers = getattr(it, "_workers", None)
        if it is before or workers is None:
            return it  # no fork happened (persistent workers), or an iterator this check does not know
        stuck = _not_started(workers, flags, timeout)
        if not stuck:
            return it
        pids = ", ".join(f"worker {i} (pid {workers[i].pid})" for i in stuck)
        _discard(loader, it, stuck)
        _restore(drawn)
        warnings.warn(
            f"phalanx: {who}: DataLoader {pids} did not start within {timeout:g} s of its fork (attempt "
            f"{attempt} of {ATTEMPTS}): CPython {sys.version.split()[0]} can fork a process that waits forever on "
            "a lock another thread held at that instant (CPython gh-112275, fixed in 3.11.10 and 3.12). phalanx "
            "stopped this pass's workers and started the pass again from the same random state. To avoid it: "
            "Python >= 3.11.10, or DataLoader(multiprocessing_context='forkserver').",
            RuntimeWarning,
            stacklevel=2,
        )
    raise RuntimeError(
        f"phalanx: {who}: DataLoader workers did not start after {ATTEMPTS} forks of {timeout:g} s each; "
        "a loaded machine can be this slow, a fork deadlock (CPython gh-112275) is not this persistent. "
        "Look at what the workers' start runs (worker_init_fn), or use multiprocessing_context='forkserver'."
    )


def _not_started(workers: list, flags: Any, timeout: float) -> list[int]:
    """Indices of the workers alive and still unmarked after `timeout` (empty as soon as all are)."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = [i for i, w in enumerate(workers) if not flags[i] and w.is_alive()]
        if not waiting or time.monotonic() > deadline:
            return waiting
        time.sleep(0.002)


def _discard(loader: DataLoader, it: Any, stuck: list[int]) -> None:
    """Kill the stuck workers and shut the iterator down (the healthy workers exit on their own)."""
    from torch.utils.data import _utils

    if getattr(it, "_worker_pids_set", False):  # before the kill: torch's SIGCHLD handler would raise
        _utils.signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
    for i in stuck:
        it._workers[i].kill()
    it._shutdown_workers()
    if getattr(loader, "_iterator", None) is it:  # persistent workers / StatefulDataLoader keep it
        loader._iterator = None


_NOTHING = object()


def _random_state(loader: DataLoader) -> tuple:
    """What `iter(loader)` draws from: torch's and Python's global generators, the loader's and its
    samplers' own generators, a StatefulDataLoader's state to resume from."""
    generators = _generators((loader.generator, loader.sampler, loader.batch_sampler))
    return (
        torch.get_rng_state(),
        random.getstate(),
        [(g, g.get_state()) for g in generators],
        getattr(loader, "next_iter_state", _NOTHING),
        loader,
    )


def _restore(drawn: tuple) -> None:
    torch_state, python_state, generators, next_iter_state, loader = drawn
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    for generator, state in generators:
        generator.set_state(state)
    if next_iter_state is not _NOTHING:
        loader.next_iter_state = next_iter_state


def _generators(roots: tuple, depth: int = 4) -> Iterator[torch.Generator]:
    """The torch.Generator objects among `roots` and their attributes, a few levels down."""
    seen: set[int] = set()
    level = list(roots)
    for _ in range(depth):
        below = []
        for obj in level:
            if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, torch.Tensor)):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Generator):
                yield obj
            elif hasattr(obj, "__dict__"):
                below.extend(vars(obj).values())
        level = below
