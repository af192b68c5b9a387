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
from typing import Any, Callable, Protocol

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

    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, TENSORBOARD_DIR))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


SINKS: dict[str, Callable[[str], Sink]] = {"csv": CSVSink, "jsonl": JSONLSink, "tensorboard": TensorBoardSink}


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def default_names() -> list[str]:
    return ["csv", "jsonl"] + (["tensorboard"] if tensorboard_installed() else [])


def create(names: list[str], run_dir: str) -> list[Sink]:
    """Sinks by name ("auto" = csv, jsonl, and tensorboard when installed)."""
    if names == ["auto"]:
        names = default_names()
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown metrics sink(s) {unknown}; valid: {', '.join(SINKS)} or auto. "
                         "HINT: for your own destination pass an object with write(step, metrics) and "
                         "close() to px.add_sink().")
    if "tensorboard" in names and not tensorboard_installed():
        raise ValueError("metrics sink 'tensorboard' needs the tensorboard package. HINT: pip install tensorboard, "
                         "or leave it out of PHALANX_LOG_SINKS / log_sinks.")
    os.makedirs(run_dir, exist_ok=True)
    return [SINKS[n](run_dir) for n in names]
