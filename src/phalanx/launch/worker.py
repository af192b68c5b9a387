"""Runs one worker's training script exactly as `python SCRIPT ARGS` / `python -m MODULE ARGS` would,
and records an uncaught exception's traceback in TORCHELASTIC_ERROR_FILE so the launcher can show
which rank failed and why, for any unmodified script (plain torchrun needs `@record` for that).

Two ways in, one per start method:
- spawn: the agent runs `python -u -m phalanx.launch.worker [-m] TARGET ARGS` (see `main`);
- fork: the agent calls `run_forked(...)` in a child forked from the launcher, which has already
  imported torch; the elastic agent's own wrapper records the traceback there.
This module imports nothing heavy: the worker's start-up time is the script's.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from phalanx import envvars, refusal
from phalanx.launch import worker_notes
from phalanx.launch.worker_exit import end_at_thread_shutdown, exit_now


def run_target(target: str, is_module: bool, args: tuple[str, ...] | list[str]) -> None:
    """Execute `target` as `__main__` with `sys.argv` and `sys.path[0]` set as the interpreter would."""
    sys.argv = [target, *args]
    if is_module:
        # `python -m` puts the working directory first on sys.path, and argv[0] becomes the file.
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # `python script.py` puts the script's directory first on sys.path.
        # and, since Python 3.9, gives it an absolute `__file__` (sys.argv[0] stays as typed)
        sys.path[0:1] = [os.path.dirname(os.path.abspath(target))]
        runpy.run_path(os.path.abspath(target), run_name="__main__")


def record_failure(error: BaseException) -> None:
    """Write `error` and its traceback where torch's elastic agent reads them (torch's format)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    # Lazy: torch is only needed when the worker has failed.
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(error)


def record_hint(text: str) -> None:
    """Write a phalanx hint where the agent reads a failed worker's error (torch's JSON layout)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    data = {
        "message": {
            "message": f"phalanx: {text}",
            "extraInfo": {"py_callstack": f"phalanx: {text}", "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as fp:
        json.dump(data, fp)


def _remember_argparse_errors() -> list[str]:
    """Keep the messages argparse exits with, to explain a missing/unknown --local-rank argument."""
    import argparse

    seen: list[str] = []
    original = argparse.ArgumentParser.error

    def error(self: argparse.ArgumentParser, message: str):  # type: ignore[no-untyped-def]
        seen.append(message)
        return original(self, message)

    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    return seen


def watch_process_group() -> dict[str, int | None] | None:
    """Under `phalanx run` (a notes directory named): record the world size of the process group the
    script joins, whoever calls torch.distributed.init_process_group (the script, Accelerate, Phalanx())."""
    if not os.environ.get(envvars.PHALANX_WORKER_NOTES):
        return None
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    seen: dict[str, int | None] = {"group_size": None, "fabric": 0}
    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):  # type: ignore[no-untyped-def]
        from phalanx.launch.misplaced_flag import nccl_without_gpu_message

        backend = kwargs.get("backend", args[0] if args else None)
        message = nccl_without_gpu_message(backend, int(os.environ.get(envvars.RANK, "0")))
        if message:  # torch would say "NCCL not built in" / "no GPUs found", without a word of gloo
            raise refusal.Refused(message)
        kwargs.update(workers_own_store(args, kwargs))
        result = original(*args, **kwargs)
        seen["group_size"] = dist.get_world_size()
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))  # noqa: SLF001 - who joined: its use
        seen["fabric"] = int(caller.split(".")[0] in ("lightning", "lightning_fabric"))
        _note_while_running(seen)
        return result

    distributed_c10d.init_process_group = dist.init_process_group = init_process_group  # type: ignore[assignment]
    children_rendezvous_themselves()
    return seen


def workers_own_store(args: tuple, kwargs: dict) -> dict:
    """Where the workers open the process group's store themselves (torch's `etcd` rendezvous: no
    agent store), rank 0's store listening on MASTER_ADDR only, as phalanx's launcher stores do
    (launch/bound_store.py), where torch's env:// store would listen on every interface: the
    `store`, `rank` and `world_size` arguments for init_process_group; {} elsewhere."""
    if os.environ.get(envvars.TORCHELASTIC_USE_AGENT_STORE, "").lower() != "false":
        return {}
    if len(args) > 1 or kwargs.get("store") is not None or kwargs.get("init_method") not in (None, "env://"):
        return {}  # the script chose its own rendezvous
    import datetime

    from torch.distributed import TCPStore

    from phalanx.launch.bound_store import bind_listener, store_on

    rank, world = int(os.environ[envvars.RANK]), int(os.environ[envvars.WORLD_SIZE])
    host, port = os.environ[envvars.MASTER_ADDR], int(os.environ[envvars.MASTER_PORT])
    timeout = kwargs.get("timeout") or datetime.timedelta(minutes=30)  # torch's default for gloo
    if rank == 0:
        store = store_on(bind_listener(host, port), host, timeout=timeout)
    else:
        store = TCPStore(host, port, is_master=False, timeout=timeout)
    return {"store": store, "rank": rank, "world_size": world}


def children_rendezvous_themselves() -> None:
    """A script that starts its own ranks with torch.multiprocessing.spawn (seed 004's `mp.spawn`)
    rendezvouses them itself (its MASTER_PORT, its ranks). They inherit this worker's
    TORCHELASTIC_USE_AGENT_STORE, which makes every one of them a client of a store nobody hosts: a
    hang. Start them without it; this worker keeps it."""
    import functools
    import importlib

    mp_spawn = importlib.import_module("torch.multiprocessing.spawn")  # the module; the package exports spawn()
    original = mp_spawn.start_processes

    @functools.wraps(original)
    def start_processes(*args, **kwargs):  # type: ignore[no-untyped-def]
        saved = os.environ.pop(envvars.TORCHELASTIC_USE_AGENT_STORE, None)
        try:
            return original(*args, **kwargs)
        finally:
            if saved is not None:
                os.environ[envvars.TORCHELASTIC_USE_AGENT_STORE] = saved

    mp_spawn.start_processes = start_processes  # type: ignore[assignment]


NOTE_AFTER_JOIN_S = 3.0  # the note while running: after Accelerate's or Fabric's set-up around the join


def _note_while_running(seen: dict[str, int | None]) -> None:
    """Leave the note a few seconds after the group is joined too, not only at the end: the launcher
    then says which settings no script took while the job runs (the note at the end replaces it)."""
    import threading

    timer = threading.Timer(NOTE_AFTER_JOIN_S, leave_note, args=(seen,))
    timer.daemon = True
    timer.start()


def leave_note(seen: dict[str, int | None] | None, finished: bool = False) -> None:
    """The worker's note for the launcher (launch/worker_notes.py): the group it joined, Accelerate,
    Fabric (which joined the group itself: its use, not its import), and whether the script has
    returned (`finished`: the note at its end; the one while it runs says False)."""
    if seen is None:
        return
    dist = sys.modules.get("torch.distributed")
    size = seen["group_size"]
    if size is None and dist is not None and dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()  # joined through a path that bypassed the watched function
    worker_notes.write(
        worker_notes.WorkerNote(
            rank=int(os.environ.get(envvars.RANK, "0")),
            group_size=size,
            accelerate=accelerator_made(),
            fabric=bool(seen.get("fabric")),
            finished=finished,
        )
    )


def accelerator_made() -> bool:
    """Whether the script made an Accelerator (HF Trainer makes one): Accelerate's shared state is
    filled then. Importing accelerate is not using it: transformers imports it on its own, and a
    plain torch script that imports transformers is no Accelerate script."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    return bool(shared)


def accelerate_on_cpu(target: str, is_module: bool) -> None:
    """A script that makes Accelerate's `PartialState()` on CPU joins the world: PartialState reads no
    variable for the CPU (Accelerator reads ACCELERATE_USE_CPU), so each process would be a silent
    world of one. Accelerate's shared state is made here first with `cpu=True`, as
    `Accelerator(cpu=True)` makes it; the script's PartialState() then takes it."""
    from phalanx.launch import framework_env

    if framework_env.makes_partial_state(framework_env.script_source(target, is_module), os.environ):
        try:
            from accelerate import PartialState
        except ImportError:  # a PartialState of the script's own: its import says what it lacks
            return
        PartialState(cpu=True)


def run_explained(target: str, is_module: bool, args: tuple[str, ...] | list[str]) -> None:
    """`run_target`, and when argparse rejects the script's local-rank argument, a hint for the report;
    under `phalanx run`, the worker's note at its end."""
    seen = _remember_argparse_errors()
    watched = watch_process_group()
    try:
        accelerate_on_cpu(target, is_module)
        run_target(target, is_module, args)
        leave_note(watched, finished=True)
    except refusal.Refused as error:  # the same on every rank: the launcher says it once, no tracebacks
        refusal.say(error, int(os.environ.get(envvars.RANK, "0")), launcher=True)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            refusal.write(os.environ["TORCHELASTIC_ERROR_FILE"], str(error))
        raise SystemExit(refusal.EXIT_CODE) from None
    except SystemExit as exit_:
        if exit_.code in (0, None):
            leave_note(watched, finished=True)
        if exit_.code not in (0, None) and seen:
            from phalanx.launch.local_rank import hint_for_argparse_error

            passed = any(arg.startswith(("--local-rank=", "--local_rank=")) for arg in args)
            hint = hint_for_argparse_error(seen[-1], passed)
            if hint is None:
                from phalanx.launch.misplaced_flag import hint_for_misplaced_flag

                hint = hint_for_misplaced_flag(seen[-1], f"-m {target}" if is_module else target, args)
            if hint:
                record_hint(hint)
        raise


def line_buffered_output() -> None:
    """One write() per line: workers sharing a terminal or pipe never merge two lines into one.

    `python -u` (torchrun's worker flag) writes a print() in several pieces ("text", "\n"), which
    other ranks' output lands between; line buffering flushes each complete line at once.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str] | None = None) -> None:
    """Entry for spawned workers: `python -m phalanx.launch.worker [-m] TARGET ARGS...`."""
    argv = sys.argv[1:] if argv is None else argv
    is_module = bool(argv) and argv[0] == "-m"
    if is_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m phalanx.launch.worker [-m] TARGET [ARGS...]")
    line_buffered_output()
    _quiet_keyboard_interrupt()
    try:
        run_explained(argv[0], is_module, argv[1:])
    except SystemExit as exit_:
        exit_now(exit_.code)
    except Exception as error:
        record_failure(error)
        raise  # the interpreter prints the traceback and exits 1, as for a plain script
    exit_now(0)


def _quiet_keyboard_interrupt() -> None:
    """Ctrl-C stops every worker at once: the launcher says so in one line, so the workers print no
    KeyboardInterrupt traceback each (the exit status still says SIGINT)."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if not issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)

    sys.excepthook = hook


def reset_inherited_process_state() -> None:
    """Undo what a forked child inherits from the launcher but a fresh interpreter would not have."""
    import atexit

    # The agent's signal handlers raise in the agent; a worker gets the interpreter's defaults.
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for name in names.split(","):
        signum = getattr(signal, name.strip(), None)
        if signum is None:
            continue
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, default)
    # The launcher's exit handlers are not the worker's; the script's own ones run at the end.
    atexit._clear()
    # numpy's global RNG is not reseeded on fork (Python's `random` is): a fresh process would
    # draw a fresh seed, so ranks must not share one.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    # A fresh interpreter sizes torch's intra-op pool from OMP_NUM_THREADS when torch loads; the
    # launcher loaded torch before that variable was set for workers, so apply it now.
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        # A fresh torch caps the pool at the cores it may use; do the same.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(min(int(threads), cores))
    # Unbuffered like torchrun's `python -u`, but a whole line per write.
    line_buffered_output()


def run_forked(target: str, is_module: bool, *args: str) -> None:
    """Entry for forked workers (a function entrypoint of torch's elastic agent)."""
    reset_inherited_process_state()
    try:
        run_explained(target, is_module, args)
    finally:
        run_exit_handlers()


def run_exit_handlers() -> None:
    """A forked worker's exit handlers, run by hand: multiprocessing ends a forked child with
    os._exit, which skips atexit. Called from a `finally`. When Ctrl-C is what ends the worker,
    SIGINT is ignored first: Ctrl-C reaches a worker twice (the terminal's, then the agent's as it
    stops the job), and the second must not land inside an exit handler (a KeyboardInterrupt
    traceback from atexit). Ignored here, before any handler runs, not inside each."""
    import atexit

    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    atexit._run_exitfuncs()


def run_in_process(target: str, is_module: bool, *args: str) -> None:
    """Entry for `--run-path` with the spawn/forkserver start methods: a fresh interpreter runs the
    script with runpy (torchrun's run_path); nothing inherited to undo. Once torch's wrapper has
    handed back the return value, the process ends as a spawned worker's does (`exit_now`: exit
    handlers, flushed output, no interpreter teardown, where gloo can hang)."""
    line_buffered_output()
    end_at_thread_shutdown(lambda: run_explained(target, is_module, args))


if __name__ == "__main__":
    main()
