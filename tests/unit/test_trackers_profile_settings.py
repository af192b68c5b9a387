"""The `trackers` and `profile` settings: names and ranges checked everywhere they can be given,
a missing tracker library named with its pip extra, and `phalanx run` refusing before any worker."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from phalanx import Phalanx, config
from phalanx.logging import sinks
from phalanx.logging.metrics import MetricsLogger
from phalanx.config import profile_steps
from tests.launcher.launch_helpers import run_cli

VALID = "csv, jsonl, tensorboard, wandb, mlflow, swanlab"


def test_unknown_tracker_lists_the_valid_names_at_phalanx_init(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path))
    with pytest.raises(
        config.ConfigError,
        match=r"Phalanx\(trackers=\['mlflow', 'neptune'\]\): unknown name\(s\) "
        f"neptune; choose from {VALID}",
    ):
        Phalanx(trackers=["mlflow", "neptune"])
    monkeypatch.setenv("PHALANX_TRACKERS", "nope")
    with pytest.raises(
        config.ConfigError, match=f"PHALANX_TRACKERS=nope: unknown name\\(s\\) nope; choose from {VALID}"
    ):
        Phalanx()
    with pytest.raises(
        ValueError, match=f"trackers: unknown metrics sink\\(s\\)/tracker\\(s\\) \\['nope'\\]; valid: {VALID}\\."
    ):
        MetricsLogger(str(tmp_path), is_main=True, sink_names=["jsonl"], trackers=["nope"]).log({"a": 1})


def test_missing_library_names_the_pip_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    with pytest.raises(
        ValueError,
        match=r"trackers: 'swanlab' needs the swanlab package\. HINT: pip install "
        r"'phalanx\[swanlab\]' \(or pip install swanlab\), or leave swanlab out of trackers\.",
    ):
        MetricsLogger(str(tmp_path), is_main=True, sink_names=["jsonl"], trackers=["swanlab"]).log({"a": 1})
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"'swanlab' needs the swanlab package"):  # at init, before any px.log
        Phalanx(trackers=["swanlab"])


def test_trackers_add_to_log_sinks_once_each():
    assert sinks.expand(["csv", "jsonl"], ["mlflow", "csv"]) == ["csv", "jsonl", "mlflow"]
    assert sinks.expand(["auto"], ["wandb"]) == sinks.default_names() + ["wandb"]


def test_schema_rows_parse_and_refuse():
    trackers, profile = config.BY_NAME["trackers"], config.BY_NAME["profile"]
    assert (trackers.env, trackers.flag, profile.env, profile.flag) == (
        "PHALANX_TRACKERS",
        "--trackers",
        "PHALANX_PROFILE",
        "--profile",
    )
    assert (trackers.default, profile.default) == (None, None)  # no trackers, no profiling
    assert trackers.kind.from_text("wandb, mlflow") == ["wandb", "mlflow"]
    assert trackers.kind.from_object(["swanlab"]) == ["swanlab"]  # from YAML
    assert profile.kind.from_text(" 10 : 15 ") == "10:15"
    assert profile_steps.parse("10:15") == profile_steps.StepRange(10, 15)
    assert 14 in profile_steps.parse("10:15") and 15 not in profile_steps.parse("10:15")
    for bad in ("5:5", "6:2", "10", "a:b", "-1:3", "1:2:3"):
        with pytest.raises(ValueError, match=f"profile range '{bad}': expected START:STOP with 0 <= START < STOP"):
            profile.kind.from_text(bad)


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (
            ["--trackers", "wandb,neptune"],
            {},
            f"--trackers wandb,neptune: unknown name(s) neptune; choose from {VALID}",
        ),
        ([], {"PHALANX_TRACKERS": "zz"}, f"PHALANX_TRACKERS=zz: unknown name(s) zz; choose from {VALID}"),
        (["--profile", "15:10"], {}, "--profile 15:10: profile range '15:10': expected START:STOP"),
    ],
)
def test_phalanx_run_refuses_bad_values_before_any_worker(tmp_path, flags, env, message):
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    result = run_cli(["run", "--nproc-per-node", "2", *flags, str(script)], env=env, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not Path(tmp_path / "started").exists()


def test_profile_counts_optimizer_steps_not_micro_steps(tmp_path, monkeypatch):
    import json

    import torch

    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path))
    px = Phalanx(profile="1:3", grad_accum_steps=2, log_sinks=["jsonl"])
    model = torch.nn.Linear(3, 1)
    model, optimizer = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for micro in range(10):  # 5 optimizer steps
        with px.accumulate(model), torch.profiler.record_function(f"micro_{micro}"):
            px.backward(model(torch.ones(2, 3)).sum())
            optimizer.step()
            optimizer.zero_grad()
    assert px.global_step == 5
    names = {
        e.get("name") for e in json.loads((tmp_path / "profile" / "rank0.pt.trace.json").read_text())["traceEvents"]
    }
    assert {n for n in names if str(n).startswith("ProfilerStep#")} == {"ProfilerStep#1", "ProfilerStep#2"}
    assert {n for n in names if str(n).startswith("micro_")} == {"micro_2", "micro_3", "micro_4", "micro_5"}


def test_phalanx_run_refuses_a_missing_tracker_library_before_any_worker(tmp_path, monkeypatch):
    from phalanx import cli
    from phalanx.launch import run_command
    from phalanx.launch.spec import LaunchError

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    args = cli.build_parser().parse_args(["run", "--trackers", "mlflow,wandb", str(script)])
    with pytest.raises(
        LaunchError, match=r"trackers: 'wandb' needs the wandb package\. HINT: pip install 'phalanx\[wandb\]'"
    ):
        run_command.spec_from_args(args)
