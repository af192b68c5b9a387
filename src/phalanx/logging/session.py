"""Wires logging, metrics and progress for one `Phalanx()`: run dir, rank logs, metrics logger."""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from phalanx import config
from phalanx.logging import progress as progress_mod
from phalanx.logging import rank_log, sinks
from phalanx.logging.metrics import MetricsLogger
from phalanx.logging.run_dir import resolve_run_dir


@dataclass
class LoggingSession:
    """What `Phalanx` delegates `log`, `progress` and `run_dir` to."""

    run_dir: str
    is_main: bool
    metrics: MetricsLogger

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        self.metrics.log(values, step)

    def progress(self, iterable: Iterable[Any], **kwargs: Any) -> progress_mod.Progress:
        enabled = progress_mod.bar_enabled(self.is_main, kwargs.pop("enabled", None))
        return progress_mod.Progress(iterable, enabled=enabled, is_main=self.is_main, metrics=self.metrics, **kwargs)


def _setting(env: Mapping[str, str], name: str, default: Any) -> Any:
    """A logging setting from its PHALANX_* variable, checked like a config file value."""
    setting = config.BY_NAME[name]
    raw = env.get(setting.env or "", "")
    if raw == "":
        return default
    try:
        return config.coerce(setting, raw)
    except config.ConfigError as error:
        raise config.ConfigError(f"environment variable {setting.env}: {error}") from None


def start(rank: int, is_main: bool, share: Callable[[Any], Any], env: Mapping[str, str] | None = None,
          trackers: list[str] | None = None) -> LoggingSession:
    """Pick the run dir (same on all ranks), configure phalanx's logger and the metrics sinks.

    `trackers` (None: PHALANX_TRACKERS) are checked here on every rank, so a bad name or a missing
    library fails at `Phalanx()`, not at the first `px.log`."""
    env = os.environ if env is None else env
    sink_names = _setting(env, "log_sinks", ["auto"])
    trackers = list(trackers) if trackers is not None else _setting(env, "trackers", [])
    sinks.expand(sink_names, trackers)
    run_dir = resolve_run_dir(env, is_main, share)
    rank_log.setup(rank, run_dir, _setting(env, "log_level", "INFO"), _setting(env, "log_all_ranks", False))
    metrics = MetricsLogger(run_dir, is_main, sink_names, trackers=trackers)
    atexit.register(metrics.close)
    return LoggingSession(run_dir, is_main, metrics)

