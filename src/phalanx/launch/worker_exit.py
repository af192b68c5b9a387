"""How a spawned worker whose script has finished ends: as a forked one does (launch/worker.py)."""

from __future__ import annotations

import os
import sys


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
