"""How a spawned worker whose script has finished ends: as a forked one does (launch/worker.py), also
when torch's agent runs it as a function (`--run-path`)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable


def exit_now(code: object) -> None:
    """End a finished worker as a forked one ends (multiprocessing's os._exit): the script's exit
    handlers run, the streams are flushed, and the interpreter's teardown is skipped.

    Why: a script that never destroys its process group (Accelerate's, many torch ones) leaves gloo's
    threads and work objects to the interpreter's finalization, where gloo's `~AsyncAllgatherWork`
    can wait on the interpreter lock for ever: the job had finished, yet its launcher (and torchrun
    alike) waited until a timeout killed it, and reported a preemption. Nothing a finished script
    left needs that teardown: files are closed by the kernel, exit handlers have run."""
    import atexit

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1, as the interpreter does
        print(code, file=sys.stderr)
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
                pass
        os._exit(status & 0xFF if status >= 0 else 1)


def end_at_thread_shutdown(run: Callable[[], None]) -> None:
    """Call `run` (the script, in a function entrypoint of torch's agent under spawn or forkserver,
    i.e. `--run-path`), and end this process the way `exit_now` does once multiprocessing is done
    with it, instead of in the interpreter's teardown.

    Why there: after `run` returns, torch's wrapper hands its return value to the agent and waits
    for the agent to read it; multiprocessing then ends the child with `sys.exit`, and the
    teardown that follows can wait on gloo for ever (see `exit_now`). Its last Python step before
    that is `threading._shutdown()`, which calls the functions registered with
    `threading._register_atexit`: this one joins the script's non-daemon threads (as the teardown
    would) and ends the process with the status multiprocessing would have given it (0, the
    script's `sys.exit` code, 1 after an exception). A KeyboardInterrupt (the agent stopping the
    job) is left to the usual way out."""
    status: list[int | None] = [1]

    def end() -> None:
        if status[0] is None:
            return
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        exit_now(status[0])

    threading._register_atexit(end)  # type: ignore[attr-defined]
    try:
        run()
    except SystemExit as exit_:
        # multiprocessing printed a message code already: the status alone, as it would give
        code = exit_.code
        status[0] = 0 if code is None else code if isinstance(code, int) else 1
        raise
    except KeyboardInterrupt:
        status[0] = None
        raise
    status[0] = 0
