"""Where `px.log()` metrics go: small sink classes behind one protocol, and a registry by name.

Files are flushed on every write, so `phalanx plot` and `tail -f` work while the run goes on and
nothing is lost if it dies.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from phalanx.config.names import METRICS_DESTINATIONS
from phalanx.logging import trackers

CSV_FILE = "metrics.csv"
JSONL_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class Sink(Protocol):
    """Receives one row of scalar metrics per `px.log()` call on the main process."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JSONLSink:
    """`metrics.jsonl`: one JSON object per call: {"step": ..., "time": ..., <metric>: ...}."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, JSONL_FILE)
        self._fp = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._fp.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
        self._fp.flush()

    def close(self) -> None:
        self._fp.close()


class CSVSink:
    """`metrics.csv`: one row per call, a column per metric name ever logged (blank where absent).

    A metric name first seen mid-run widens the header: the file is rewritten once with the new
    column, so the CSV stays rectangular for spreadsheets and pandas.
    """

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, CSV_FILE)
        self.columns: list[str] = ["step", "time"]
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, newline="", encoding="utf-8") as fp:
                self.columns = next(csv.reader(fp))
        else:
            self._rewrite([])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        new = [k for k in metrics if k not in self.columns]
        if new:
            with open(self.path, newline="", encoding="utf-8") as fp:
                rows = list(csv.DictReader(fp))
            self.columns += new
            self._rewrite(rows)
        row = {"step": step, "time": round(time.time(), 3), **metrics}
        with open(self.path, "a", newline="", encoding="utf-8") as fp:
            csv.DictWriter(fp, self.columns).writerow(row)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as fp:
            writer = csv.DictWriter(fp, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Event files under `tensorboard/` for `tensorboard --logdir RUN_DIR` (needs `tensorboard`)."""

    def __init__(self, run_dir: str, params: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, TENSORBOARD_DIR))
        if params:
            self.log_params(params)

    def log_params(self, params: dict[str, Any]) -> None:
        """The run's settings in TensorBoard's HParams tab (in the same event file as the scalars)."""
        from torch.utils.tensorboard.summary import hparams

        from phalanx.logging.trackers import plain_params

        for summary in hparams(plain_params(params), {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True)
class Destination:
    """One name `log_sinks` / `trackers` accept: how to build it and which package it needs."""

    build: Callable[[trackers.RunInfo], Sink]
    package: str | None = None  # the module that must be importable
    extra: str | None = None  # phalanx's pip extra that installs it


# The one registry of names for both settings: files first, then experiment trackers.
REGISTRY: dict[str, Destination] = {
    "csv": Destination(lambda run: CSVSink(run.run_dir)),
    "jsonl": Destination(lambda run: JSONLSink(run.run_dir)),
    "tensorboard": Destination(lambda run: TensorBoardSink(run.run_dir, run.params), "tensorboard", "tensorboard"),
    "wandb": Destination(trackers.WandbTracker, "wandb", "wandb"),
    "mlflow": Destination(trackers.MLflowTracker, "mlflow", "mlflow"),
    "swanlab": Destination(trackers.SwanLabTracker, "swanlab", "swanlab"),
}
NAMES: tuple[str, ...] = tuple(REGISTRY)
assert NAMES == METRICS_DESTINATIONS, "config/names.py lists the destinations the settings accept"


def installed(name: str) -> bool:
    package = REGISTRY[name].package
    return package is None or importlib.util.find_spec(package) is not None


def tensorboard_installed() -> bool:
    return installed("tensorboard")


def default_names() -> list[str]:
    return ["csv", "jsonl"] + (["tensorboard"] if tensorboard_installed() else [])


def check_names(names: list[str], setting: str = "log_sinks") -> list[str]:
    """Refuse unknown names (listing the valid ones) and names whose library is missing (naming the extra)."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(
            f"{setting}: unknown metrics sink(s)/tracker(s) {unknown}; valid: {', '.join(NAMES)}"
            + (" or auto" if setting == "log_sinks" else "")
            + ". HINT: for your own destination pass an object with write(step, metrics) and "
            "close() to px.add_sink()."
        )
    for name in names:
        if not installed(name):
            dest = REGISTRY[name]
            raise ValueError(
                f"{setting}: {name!r} needs the {dest.package} package. HINT: pip install "
                f"'phalanx[{dest.extra}]' (or pip install {dest.package}), or leave {name} out of "
                f"{setting}."
            )
    return names


def expand(sink_names: list[str], tracker_names: list[str] | None = None) -> list[str]:
    """The destinations of one run: `log_sinks` ("auto" = csv, jsonl, tensorboard when installed)
    plus `trackers`, each name once, in that order."""
    names = default_names() if sink_names == ["auto"] else list(sink_names)
    check_names(names, "log_sinks")
    for name in check_names(list(tracker_names or []), "trackers"):
        if name not in names:
            names.append(name)
    return names


def create(
    names: list[str], run_dir: str, run: trackers.RunInfo | None = None, tracker_names: list[str] | None = None
) -> list[Sink]:
    """Sinks by name ("auto" = csv, jsonl, and tensorboard when installed), plus the trackers."""
    names = expand(names, tracker_names)
    os.makedirs(run_dir, exist_ok=True)
    run = run if run is not None else trackers.RunInfo(run_dir)
    return [REGISTRY[n].build(run) for n in names]
