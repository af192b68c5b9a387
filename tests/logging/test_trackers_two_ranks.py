"""`phalanx run --trackers wandb,mlflow,swanlab,tensorboard --profile 3:5` on 2 ranks, all offline.

One launch (imports cost seconds per process); each test reads back one tracker's files with that
library's own reader: exactly one run per job (the main process's), every logged value at its step,
the run's settings and `px.log_hyperparams` as hyper-parameters, the run named after the run dir.
The same job checks the profiler: one Chrome trace per rank holding steps 3 and 4 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import run_cli
from tests.logging import tracker_readers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).parent / "scripts" / "train_tracked.py"
STEPS = 8  # train_tracked.py: 8 optimizer steps per rank on 2 ranks
VALUES = {step: step / 4 for step in range(STEPS)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    run_dir = root / "run-42"
    env = {
        "PHALANX_RUN_DIR": str(run_dir),
        "PHALANX_LOG_SINKS": "jsonl",
        "PHALANX_TRACKERS": None,
        "PHALANX_PROFILE": None,
        "PHALANX_STRATEGY": "ddp",
        "WANDB_MODE": "offline",
        "SWANLAB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "MLFLOW_TRACKING_URI": None,
        "WANDB_SILENT": "true",
    }
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--trackers",
            "wandb,mlflow,swanlab,tensorboard",
            "--profile",
            "3:5",
            str(SCRIPT),
        ],
        cwd=root,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} done after {STEPS} steps" in result.stdout
    return result, run_dir


def _only(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths  # one run per job, not one per rank
    return paths[0]


def _check_params(params: dict, strategy_key: str = "strategy") -> None:
    assert params[strategy_key] == "ddp"
    assert str(params["world_size"]) == "2"
    assert str(params["lr"]) == "0.1" and str(params["batch_size"]) == "4"  # px.log_hyperparams
    assert params["trackers"] == "wandb,mlflow,swanlab,tensorboard"


# A new user's reader: a fresh interpreter, no MLflow variable set, MLflow's own defaults.
_MLFLOW_READER = """
import json, sys
from mlflow import MlflowClient
client = MlflowClient(*sys.argv[1:])  # a tracking URI, or none: MLflow's default (sqlite:///mlflow.db here)
runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
print(json.dumps([{"name": r.info.run_name, "status": r.info.status, "params": r.data.params,
                   "artifacts": r.info.artifact_uri,
                   "value": {m.step: m.value for m in client.get_metric_history(r.info.run_id, "value")},
                   "losses": len(client.get_metric_history(r.info.run_id, "loss"))} for r in runs]))
"""


@pytest.mark.parametrize("how", ["explicit uri", "mlflow's default in the run dir"])
def test_mlflow_sqlite_store_is_read_by_a_fresh_client_with_no_variables(run, how):
    result, run_dir = run
    store = f"sqlite:///{run_dir / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    argv = [sys.executable, "-c", _MLFLOW_READER] + ([store] if how == "explicit uri" else [])
    read = subprocess.run(argv, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-3000:]
    mlrun = _only(json.loads(read.stdout.strip().splitlines()[-1]))
    assert mlrun["name"] == "run-42" and mlrun["status"] == "FINISHED"
    assert {int(step): value for step, value in mlrun["value"].items()} == VALUES
    assert mlrun["losses"] == STEPS
    assert mlrun["artifacts"].startswith((run_dir / "mlartifacts").as_uri())  # files stay in the run dir
    _check_params(mlrun["params"])
    assert not (run_dir / "mlruns").exists() and not (run_dir.parent / "mlruns").exists()
    assert f"MLflow: mlflow ui --backend-store-uri {store}" in result.stderr  # the start-up line says how


def test_wandb_offline_run_holds_metrics_and_config(run):
    _, run_dir = run
    log = _only(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")))
    history = tracker_readers.wandb_history(log)
    assert history["value"] == VALUES and len(history["loss"]) == STEPS
    name, config = tracker_readers.wandb_run(log)
    assert name == "run-42"
    _check_params(config)


def test_swanlab_offline_run_holds_metrics_and_config(run):
    import yaml

    _, run_dir = run
    folder = _only(list((run_dir / "swanlog").glob("run-*")))
    name, scalars = tracker_readers.swanlab_scalars(_only(list(folder.glob("run-*.swanlab"))))
    assert name == "run-42"
    assert scalars["value"] == VALUES and len(scalars["loss"]) == STEPS
    config = yaml.safe_load((folder / "files" / "config.yaml").read_text())
    _check_params({key: entry["value"] for key, entry in config.items()})


def test_tensorboard_events_hold_metrics_and_hparams(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    _, run_dir = run
    _only(list((run_dir / "tensorboard").glob("events.out.tfevents.*")))
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("value")} == VALUES
    content = events.PluginTagToContent("hparams")
    info = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {k: v.string_value or v.number_value for k, v in info.hparams.items()}
    _check_params(
        {k: (int(v) if isinstance(v, float) and v.is_integer() and k != "lr" else v) for k, v in hparams.items()}
    )


def test_profiler_writes_one_trace_per_rank_with_the_profiled_steps(run):
    result, run_dir = run
    traces = sorted((run_dir / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for trace in traces:
        names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {n for n in names if str(n).startswith("ProfilerStep#")} == {"ProfilerStep#3", "ProfilerStep#4"}
        assert {n for n in names if str(n).startswith("user_step_")} == {"user_step_3", "user_step_4"}
        assert any(str(n).startswith("aten::") for n in names)  # the ops themselves, not only markers
    assert (
        f"profiler: trace of optimizer steps 3:5 written to {run_dir / 'profile' / 'rank0.pt.trace.json'}"
        in result.stderr
    )
