"""Wires logging, metrics and progress for one `Phalanx()`: run dir, rank logs, metrics logger."""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from phalanx.logging import progress as progress_mod
from phalanx.logging import rank_log, sinks
from phalanx.logging.metrics import MetricsLogger
from phalanx.logging.run_dir import resolve_run_dir
from phalanx.logging.throughput import Throughput


@dataclass
class LoggingSession:
    """What `Phalanx` delegates `log`, `progress` and `run_dir` to."""

    run_dir: str
    is_main: bool
    metrics: MetricsLogger
    progress_setting: str = "auto"
    open_hint: str = ""  # for the start-up line: how to open what the trackers write (MLflow's store)

    @property
    def throughput(self) -> Throughput:
        return self.metrics.throughput  # type: ignore[return-value]

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        self.metrics.log(values, step)

    def progress(self, iterable: Iterable[Any], **kwargs: Any) -> progress_mod.Progress:
        enabled = progress_mod.bar_enabled(self.is_main, kwargs.pop("enabled", None) or self.progress_setting)
        return progress_mod.Progress(iterable, enabled=enabled, is_main=self.is_main, metrics=self.metrics, **kwargs)


@dataclass(frozen=True)
class LoggingSettings:
    """The logging rows of the settings schema, resolved."""

    run_dir: str | None = None
    log_level: str = "INFO"
    log_all_ranks: bool = False
    log_sinks: tuple[str, ...] = ("auto",)
    progress: str = "auto"
    trackers: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: Any) -> "LoggingSettings":
        return cls(
            cfg.run_dir, cfg.log_level, cfg.log_all_ranks, tuple(cfg.log_sinks), cfg.progress, tuple(cfg.trackers or ())
        )


def start(
    rank: int,
    is_main: bool,
    share: Callable[[Any], Any],
    settings: LoggingSettings = LoggingSettings(),
    world_size: int = 1,
) -> LoggingSession:
    """Pick the run dir (same on all ranks), configure phalanx's logger and the metrics sinks.

    Sinks and trackers are checked here on every rank (names, installed libraries), so a missing
    library fails at `Phalanx()`, not at the first `px.log`; they open at the first `px.log`."""
    sinks.expand(list(settings.log_sinks), list(settings.trackers))
    run_dir = resolve_run_dir(settings.run_dir, is_main, share)
    rank_log.setup(rank, run_dir, settings.log_level, settings.log_all_ranks)
    metrics = MetricsLogger(run_dir, is_main, list(settings.log_sinks), trackers=list(settings.trackers))
    metrics.throughput = Throughput(world_size)
    atexit.register(metrics.close)
    return LoggingSession(run_dir, is_main, metrics, settings.progress, _open_hint(run_dir, is_main, settings.trackers))


def _open_hint(run_dir: str, is_main: bool, trackers: tuple[str, ...]) -> str:
    """'; MLflow: mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db' when the main process writes there."""
    if not is_main or "mlflow" not in trackers:
        return ""
    from phalanx.logging.trackers import mlflow_open_hint

    command = mlflow_open_hint(run_dir)
    return f"; MLflow: {command}" if command else ""
