"""The launcher's failure report and exit code, and where torch's own agent logging goes.

A failed run ends with phalanx's report only: the rank that failed first (by when each process ended,
launch/exit_times.py; else by the failure times torch records, refined by the watchdog's sub-second
note; never by rank order), its host, step, exit code or signal, its own traceback, then the other
ranks that failed on their own, and where the full logs are. `phalanx
run` exits with that rank's code, or 128 + the signal number when a signal killed it, as a shell
would.

torch's elastic agent logs through the `torch` and `torch.distributed` loggers (a dozen lines and a
traceback per failure, 29-40 lines in all): `quiet_agent_logging` sends them to a log file and
keeps them off the terminal unless asked for (`--verbose`, or a DEBUG log level).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Iterator

from phalanx import store_keys
from phalanx.logging.printable import printable
from phalanx.launch.restarts import describe_exit, first_failures_first

AGENT_LOG_NAME = "launcher.log"
_TORCH_LOGGERS = ("torch", "torch.distributed")  # the two torch gives a stderr handler of its own
_WRAPPER_FRAMES = (
    "<frozen runpy>",
    "phalanx/launch/worker.py",
    "phalanx/launch/spawn.py",
    "elastic/multiprocessing/errors",
)
_PACKAGE_FRAME = f'  File "{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}{os.sep}'


def exit_code(exitcode: int) -> int:
    """The launcher's exit code for a worker's: its own, or 128 + N for a death by signal N."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if exitcode > 0 else 1  # a "failure" that returned 0 must still not read as success


def ordered_failures(
    failures: dict[int, Any],
    progress: dict[int, store_keys.RankProgress],
    ended_at: dict[int, float] | None = None,
) -> list[tuple[int, Any]]:
    """Failures, the first one first (see `restarts.first_failures_first`)."""
    return first_failures_first(failures, progress, ended_at)


def _is_phalanx_message(text: str) -> bool:
    """The traceback ends in one of phalanx's own errors with its HINT (a dependency gone, a refusal)."""
    last = text.rstrip().splitlines()[-1] if text.strip() else ""
    return last.startswith("phalanx.") and "HINT:" in last


def trim_traceback(text: str) -> str:
    """Drop the frames of phalanx's worker wrapper, runpy and torch's `record`: users see their own.
    Under a phalanx message (one with a HINT) phalanx's own frames go too: the message says it all,
    and the full traceback stays in the rank's log."""
    kept: list[str] = []
    skipping = False
    markers = _WRAPPER_FRAMES + ((_PACKAGE_FRAME,) if _is_phalanx_message(text) else ())
    for line in text.splitlines():
        if line.startswith("  File "):
            skipping = any(marker in line for marker in markers)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _traceback(failure: Any) -> str | None:
    message = failure.error_file_data.get("message") if failure.error_file_data else None
    if isinstance(message, dict):
        return trim_traceback(message.get("extraInfo", {}).get("py_callstack", "")).rstrip() or None
    if isinstance(message, str) and message and message != "<NONE>":
        return message
    return None


def format_failures(
    error: Any,
    nproc_per_node: int,
    progress: dict[int, store_keys.RankProgress] | None = None,
    log_dir: str | None = None,
    host: str | None = None,
    ended_at: dict[int, float] | None = None,
) -> str:
    """`phalanx: rank R (local rank L on node N) failed with exit code C`, then `  on host H, at step
    S` and its traceback, the first failure first; then where the full logs are."""
    progress = progress or {}
    host = printable(host or socket.gethostname())  # a name from the environment: no terminal escapes
    lines: list[str] = []
    shown: dict[str, int] = {}  # a traceback already shown -> the rank it was shown for
    for index, (rank, failure) in enumerate(ordered_failures(error.failures, progress, ended_at)):
        node = (rank - failure.local_rank) // max(1, nproc_per_node)
        how = describe_exit(failure.exitcode, failure.signal_name() if failure.exitcode < 0 else None)
        how = f"was {how}" if failure.exitcode < 0 else f"failed with {how}"
        trace = _traceback(failure)
        header = f"phalanx: rank {rank} (local rank {failure.local_rank} on node {node}) {how}"
        if trace and trace in shown:  # every rank raised the same message (an agreed save failure): once
            lines.append(f"{header}, with the same error as rank {shown[trace]}")
            continue
        step = progress.get(rank, store_keys.RankProgress()).step
        at = f", at step {step}" if step is not None and step >= 0 else ""
        first = " (first)" if index == 0 and len(error.failures) > 1 else ""
        lines.append(header)
        lines.append(f"  on host {host}{at}{first}")
        if trace:
            shown[trace] = rank
            lines.append(trace)
    if log_dir:
        lines.append(f"phalanx: full logs in {log_dir}")
    return "\n".join(lines)


def first_exit_code(
    error: Any, progress: dict[int, store_keys.RankProgress] | None = None, ended_at: dict[int, float] | None = None
) -> int:
    """`phalanx run`'s exit code for a ChildFailedError: the first failed rank's."""
    ordered = ordered_failures(error.failures, progress or {}, ended_at)
    return exit_code(ordered[0][1].exitcode) if ordered else 1


def agent_log_level_is_debug(env: dict[str, str] | os._Environ) -> bool:
    """PHALANX_LOG_LEVEL=DEBUG (or torch's LOGLEVEL=DEBUG) shows the agent's logging too."""
    from phalanx import config

    return (
        env.get(config.BY_NAME["log_level"].env or "", "").upper() == "DEBUG"
        or env.get("LOGLEVEL", "").upper() == "DEBUG"
    )


class _Hide(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


_installed: list[tuple[logging.Logger, logging.Handler | None, _Hide]] = []  # undone in forked workers


def _undo() -> None:
    for logger, file_handler, hide in _installed:
        for handler in logger.handlers:
            handler.removeFilter(hide)
        if file_handler is not None:
            logger.removeHandler(file_handler)
    _installed.clear()


@contextlib.contextmanager
def quiet_agent_logging(log_path: str | None, verbose: bool) -> Iterator[None]:
    """torch's agent logging to `log_path` (all of it), and to the terminal only when `verbose`.

    Forked workers inherit the launcher's loggers: they get torch's own handlers back, untouched.
    """
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_undo)
        _fork_hook_registered.append(True)
    file_handler = None
    if log_path:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        file_handler = logging.FileHandler(log_path)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    hide = _Hide()
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        if not verbose:
            for handler in logger.handlers:
                handler.addFilter(hide)
        if file_handler is not None:
            logger.addHandler(file_handler)
        _installed.append((logger, file_handler, hide))
    try:
        yield
    finally:
        _undo()
        if file_handler is not None:
            file_handler.close()


_fork_hook_registered: list[bool] = []
