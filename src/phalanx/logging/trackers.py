"""Experiment trackers behind `px.log()`: Weights & Biases, MLflow and SwanLab, as sinks.

Each wraps the real library (an optional extra: `pip install 'phalanx[wandb]'`, ...), runs on the
main process only (the metrics logger never opens sinks elsewhere), names its run after the phalanx
run directory, keeps its files inside that directory, and logs the run's settings as
hyper-parameters. Offline use is the library's own: `WANDB_MODE=offline`, `SWANLAB_MODE=offline`;
MLflow writes to a local file store in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI names another.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from typing import Any

MLRUNS_DIR = "mlruns"
SWANLAB_DIR = "swanlog"


@dataclass
class RunInfo:
    """What every tracker shares: the run directory, the run's name and its hyper-parameters."""

    run_dir: str
    name: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = os.path.basename(os.path.normpath(self.run_dir))


def plain_params(params: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters as numbers, booleans or strings (what every tracker can store)."""
    def plain(value: Any) -> Any:
        if isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)):
            return ",".join(map(str, value))
        return str(value)

    return {k: plain(v) for k, v in params.items() if v is not None}


class WandbTracker:
    """A W&B run in RUN_DIR/wandb (offline with WANDB_MODE=offline); `wandb sync` uploads it later."""

    def __init__(self, run: RunInfo):
        import wandb

        self._run = wandb.init(name=run.name, dir=run.run_dir, config=plain_params(run.params))
        atexit.register(self.close)  # before wandb's own exit hook (registered earlier) ends its service

    def log_params(self, params: dict[str, Any]) -> None:
        self._run.config.update(plain_params(params), allow_val_change=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()


class MLflowTracker:
    """An MLflow run named after the run directory, in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set."""

    def __init__(self, run: RunInfo):
        import mlflow
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

        if not is_tracking_uri_set():
            # MLflow 3 keeps its file store behind an opt-in (an env variable): a local store is the point here.
            _allow_mlflow_file_store()
            mlflow.set_tracking_uri("file://" + os.path.abspath(os.path.join(run.run_dir, MLRUNS_DIR)))
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=run.name)
        self.log_params(run.params)
        atexit.register(self.close)

    def log_params(self, params: dict[str, Any]) -> None:
        if params:
            self._mlflow.log_params(plain_params(params))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._mlflow.end_run()


def _allow_mlflow_file_store() -> None:
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # MLflow 2: the file store needs no opt-in
        return
    if not MLFLOW_ALLOW_FILE_STORE.defined:
        MLFLOW_ALLOW_FILE_STORE.set("true")


class SwanLabTracker:
    """A SwanLab experiment in RUN_DIR/swanlog (SWANLAB_MODE=offline or local keeps it on disk)."""

    def __init__(self, run: RunInfo):
        import swanlab

        self._swanlab = swanlab
        self._run = swanlab.init(experiment_name=run.name, logdir=os.path.join(run.run_dir, SWANLAB_DIR),
                                 config=plain_params(run.params))
        atexit.register(self.close)

    def log_params(self, params: dict[str, Any]) -> None:
        self._run.config.update(plain_params(params))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._swanlab.log(dict(metrics), step=step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._swanlab.finish()
