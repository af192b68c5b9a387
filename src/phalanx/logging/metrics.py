"""`px.log({...}, step=...)`: scalar metrics from the main process to the console and the sinks."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping

from phalanx.logging import sinks as sink_registry
from phalanx.logging.printable import printable
from phalanx.logging.throughput import MFU, SAMPLES, TOKENS, TOKENS_LOGGED, Throughput
from phalanx.logging.trackers import RunInfo


def to_scalar(name: str, value: Any) -> float | int:
    """A Python number from a number, a one-element tensor or a numpy scalar."""
    if hasattr(value, "item") and (not hasattr(value, "numel") or value.numel() == 1):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"px.log: metric {name!r} must be a number or a one-element tensor, got {type(value).__name__} "
            f"{value!r:.80}. HINT: reduce it first, e.g. px.reduce(loss).item()."
        )
    return int(value) if isinstance(value, numbers.Integral) else float(value)


_SHORT = {SAMPLES: "samples/s", TOKENS: "tokens/s"}


def postfix(row: Mapping[str, Any]) -> dict[str, str]:
    """A row as a progress bar's postfix shows it (rates by their short names, MFU in percent)."""
    shown = {}
    for k, v in row.items():
        if k == MFU:
            shown["MFU"] = f"{100 * v:.1f}%"
        else:
            shown[printable(_SHORT.get(k, k))] = f"{v:.4g}" if isinstance(v, float) else printable(v)
    return shown


def format_line(step: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}"]
    for name, value in metrics.items():
        name = printable(name)
        parts.append(
            f"{name} {value:.4g}" if isinstance(value, float) and math.isfinite(value) else f"{name} {printable(value)}"
        )
    return " | ".join(parts)


class MetricsLogger:
    """Fans one metrics row out to the sinks; only the main process writes anything.

    The values are this process's: reduce across ranks first (`px.reduce`) to log a global figure.
    Sinks are created on the first call, so a run that logs nothing leaves no metrics files.
    """

    def __init__(
        self,
        run_dir: str,
        is_main: bool,
        sink_names: list[str],
        console: bool = True,
        trackers: list[str] | None = None,
        params: Callable[[], dict[str, Any]] | None = None,
    ):
        """`trackers`: more destinations by name (wandb, mlflow, ...), opened with the sinks.
        `params`: the run's settings, asked for when the sinks open (strategy auto has decided by
        then) and logged by the trackers as hyper-parameters."""
        self.run_dir = run_dir
        self.is_main = is_main
        self.sink_names = sink_names
        self.tracker_names = list(trackers or [])
        self.params = params
        self.extra_params: dict[str, Any] = {}
        self.console = console
        self.sinks: list[sink_registry.Sink] | None = None
        self.progress_bar: Any = None  # the active px.progress bar: metrics show in its postfix
        self.postfix: dict[str, str] = {}  # the last row as the bar shows it
        self.throughput: Throughput | None = None  # rates added to every row (samples/s, tokens/s, MFU)
        self._next_step = 0
        self.last_row: tuple[int, dict[str, float]] | None = None  # (step, row): `phalanx top` shows it

    def add_sink(self, sink: sink_registry.Sink) -> None:
        if self.is_main:
            self._open().append(sink)

    def _open(self) -> list[sink_registry.Sink]:
        if self.sinks is None:
            params = {**(self.params() if self.params is not None else {}), **self.extra_params}
            self.sinks = sink_registry.create(
                self.sink_names, self.run_dir, RunInfo(self.run_dir, params=params), self.tracker_names
            )
        return self.sinks

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Add hyper-parameters for the trackers (those open now get them at once)."""
        if not self.is_main:
            return
        self.extra_params.update(params)
        for sink in self.sinks or []:
            if callable(getattr(sink, "log_params", None)):
                sink.log_params(dict(params))

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not self.is_main:
            return
        if not isinstance(metrics, Mapping) or not metrics:
            raise ValueError(f"px.log expects a non-empty dict of name -> number, got {metrics!r:.80}")
        row = {str(name): to_scalar(str(name), value) for name, value in metrics.items()}
        if self.throughput is not None:
            rates = self.throughput.snapshot(row.get(TOKENS_LOGGED))
            row.update({k: v for k, v in rates.items() if k not in row})
        if step is None:
            step = self._next_step
        self._next_step = int(step) + 1
        self.last_row = (int(step), row)
        for sink in self._open():
            sink.write(int(step), row)
        self.postfix = postfix(row)
        if self.progress_bar is not None:
            self.progress_bar.set_postfix(self.postfix)
        elif self.console:
            print(format_line(int(step), row), flush=True)

    def record(self, step: int, values: Mapping[str, float]) -> None:
        """Write `values` to the sinks and trackers only: no console line, no rates, the user's step
        counter untouched (phalanx's own figures, e.g. a straggler named at `step`)."""
        if self.is_main:
            for sink in self._open():
                sink.write(int(step), dict(values))

    def close(self) -> None:
        for sink in self.sinks or []:
            sink.close()
        self.sinks = None
