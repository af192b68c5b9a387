"""Experiment trackers behind `px.log()`: Weights & Biases, MLflow and SwanLab, as sinks.

Each wraps the real library (an optional extra: `pip install 'phalanx[wandb]'`, ...), runs on the
main process only (the metrics logger never opens sinks elsewhere), names its run after the phalanx
run directory, keeps its files inside that directory, and logs the run's settings as
hyper-parameters. Offline use is the library's own: `WANDB_MODE=offline`, `SWANLAB_MODE=offline`;
MLflow writes to a SQLite store, RUN_DIR/mlflow.db, unless MLFLOW_TRACKING_URI names another: the
store MLflow 3's client and `mlflow ui` read with their defaults (its file store needs an opt-in).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlartifacts"
MLFLOW_EXPERIMENT = "phalanx"
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


def mlflow_store_uri(run_dir: str) -> str:
    """The run's own MLflow store: a SQLite database in the run directory."""
    return "sqlite:///" + os.path.abspath(os.path.join(run_dir, MLFLOW_DB))


def mlflow_open_hint(run_dir: str) -> str | None:
    """The command that opens the run's MLflow store; None when MLFLOW_TRACKING_URI names another."""
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

    if is_tracking_uri_set():
        return None
    return f"mlflow ui --backend-store-uri {mlflow_store_uri(run_dir)}"


class MLflowTracker:
    """An MLflow run named after the run directory, in RUN_DIR/mlflow.db unless MLFLOW_TRACKING_URI is set."""

    def __init__(self, run: RunInfo):
        import mlflow
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

        experiment_id = None
        if not is_tracking_uri_set():
            uri = mlflow_store_uri(run.run_dir)
            mlflow.set_tracking_uri(uri)
            experiment_id = _own_experiment(uri, os.path.join(run.run_dir, MLFLOW_ARTIFACTS_DIR))
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=run.name, experiment_id=experiment_id)
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


def _own_experiment(uri: str, artifact_dir: str) -> str | None:
    """The "phalanx" experiment of the run's store, its artifacts kept in the run directory (MLflow's
    Default experiment would put them in ./mlruns of the working directory). None where the user
    picked an experiment through MLflow's own variables."""
    from mlflow import MlflowClient
    from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID, MLFLOW_EXPERIMENT_NAME

    if MLFLOW_EXPERIMENT_NAME.defined or MLFLOW_EXPERIMENT_ID.defined:
        return None
    client = MlflowClient(tracking_uri=uri)
    existing = client.get_experiment_by_name(MLFLOW_EXPERIMENT)  # a run directory used again
    if existing is not None:
        return existing.experiment_id
    return client.create_experiment(MLFLOW_EXPERIMENT, artifact_location=Path(artifact_dir).absolute().as_uri())


class SwanLabTracker:
    """A SwanLab experiment in RUN_DIR/swanlog (SWANLAB_MODE=offline or local keeps it on disk)."""

    def __init__(self, run: RunInfo):
        import swanlab

        self._swanlab = swanlab
        self._run = swanlab.init(
            experiment_name=run.name, logdir=os.path.join(run.run_dir, SWANLAB_DIR), config=plain_params(run.params)
        )
        atexit.register(self.close)

    def log_params(self, params: dict[str, Any]) -> None:
        self._run.config.update(plain_params(params))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._swanlab.log(dict(metrics), step=step)

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._swanlab.finish()
