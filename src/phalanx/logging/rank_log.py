"""phalanx's own messages through `logging`: `[rank N]` on every line, the console shows rank 0's
INFO and every rank's warnings by default, and each rank keeps a full log file in the run directory.

Modules log with `logging.getLogger("phalanx.<area>")` (see `get_logger`); the user's own logging
configuration is left alone (the "phalanx" logger does not propagate to the root logger).
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "phalanx"
_MARK = "_phalanx_handler"


def get_logger(area: str | None = None) -> logging.Logger:
    """The logger for one phalanx area, e.g. get_logger("checkpoint") -> "phalanx.checkpoint"."""
    return logging.getLogger(ROOT if not area else f"{ROOT}.{area}")


def log_file_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"rank{rank}.log")


class _LazyFileHandler(logging.FileHandler):
    """Creates its directory and file on the first record, not before."""

    def _open(self):  # type: ignore[override]
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()


def setup(rank: int, run_dir: str | None, level: str = "INFO", all_ranks: bool = False) -> logging.Logger:
    """(Re)configure the "phalanx" logger for this rank; safe to call again (replaces its handlers)."""
    logger = get_logger()
    for handler in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(handler)
        handler.close()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR")
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(numeric if rank == 0 or all_ranks else max(numeric, logging.WARNING))
    console.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [console]
    if run_dir is not None:
        file = _LazyFileHandler(log_file_path(run_dir, rank), encoding="utf-8", delay=True)
        file.setLevel(numeric)
        file.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
        handlers.append(file)
    for handler in handlers:
        setattr(handler, _MARK, True)
        logger.addHandler(handler)
    logger.setLevel(numeric)
    logger.propagate = False
    return logger
