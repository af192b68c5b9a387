"""What `phalanx run` hands Accelerate, and what it says after a run from the workers' notes. Pure."""

import copy

import pytest
import torch

from phalanx import config
from phalanx.launch import framework_env, worker_notes
from phalanx.launch.worker_notes import WorkerNote


def settings(**flags):
    return config.resolve(config.from_flags(flags))


def test_accelerate_gets_the_cpu_and_the_precision_and_never_overrides_the_users_variables():
    assert framework_env.accelerate_env(settings(mixed_precision="bf16"), 0, {}) == {
        "ACCELERATE_USE_CPU": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    assert framework_env.accelerate_env(settings(), 0, {"ACCELERATE_USE_CPU": "false"}) == {}
    assert framework_env.accelerate_env(None, 2, {}) == {}


@pytest.mark.parametrize("strategy, reshard", [("zero3", "true"), ("zero2", "false")])
def test_on_gpus_a_sharded_strategy_becomes_accelerates_fsdp2(strategy, reshard):
    assert framework_env.accelerate_env(settings(strategy=strategy), 2, {}) == {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": reshard,
    }
    assert "ACCELERATE_USE_FSDP" not in framework_env.accelerate_env(settings(strategy=strategy), 0, {})


FABRIC_LAUNCHES = "fabric = Fabric(devices=2)  # not `fabric run`\nfabric.launch()\n"
FABRIC_FOR_CLI = '"""Run with `fabric run` (no `fabric.launch()`)."""\nfabric = Fabric()  # .launch( never\n'


def test_fabric_gets_fabric_runs_variables_less_the_cli_mark_when_the_script_launches():
    for_cli = framework_env.fabric_env(settings(mixed_precision="bf16"), 2, 1, 0, {}, FABRIC_FOR_CLI)
    assert for_cli == {
        "LT_CLI_USED": "1",
        "LT_ACCELERATOR": "cpu",
        "LT_DEVICES": "2",
        "LT_NUM_NODES": "1",
        "LT_PRECISION": "bf16-mixed",
    }
    launches = framework_env.fabric_env(settings(mixed_precision="bf16"), 2, 1, 0, {}, FABRIC_LAUNCHES)
    assert launches == {key: value for key, value in for_cli.items() if key != "LT_CLI_USED"}
    assert framework_env.calls_launch("def main(fabric): ...\nFabric().launch(main)\n")
    assert not framework_env.calls_launch("launch = 1\n# fabric.launch()\nprint('.launch(')\n")
    assert not framework_env.calls_launch("fabric.launch(  # a script that does not parse\n")


def test_a_partial_state_script_on_cpu_gets_its_state_made_with_cpu():
    env = {"ACCELERATE_USE_CPU": "true", "WORLD_SIZE": "2"}
    script = "from accelerate import PartialState\nstate = PartialState()\n"
    assert framework_env.makes_partial_state(script, env)
    assert framework_env.makes_partial_state("import accelerate\nstate = accelerate.PartialState()\n", env)
    assert not framework_env.makes_partial_state(script, {**env, "ACCELERATE_USE_CPU": "false"})  # the user's GPUs
    assert not framework_env.makes_partial_state(script, {**env, "WORLD_SIZE": "1"})
    assert not framework_env.makes_partial_state("from accelerate import Accelerator\n# PartialState\n", env)


def test_the_source_of_a_script_a_module_and_a_package(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("A = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (tmp_path / "pkg" / "__main__.py").write_text("MAIN = 1\n")
    (tmp_path / "pkg" / "job.py").write_text("JOB = 1\n")
    monkeypatch.chdir(tmp_path)
    assert framework_env.script_source("train.py", is_module=False) == "A = 1\n"
    assert framework_env.script_source("train", is_module=True) == "A = 1\n"
    assert framework_env.script_source("pkg", is_module=True) == "MAIN = 1\n"
    assert framework_env.script_source("pkg.job", is_module=True) == "JOB = 1\n"
    assert framework_env.script_source("missing.py", is_module=False) == ""
    assert framework_env.script_source("no_such_module_x", is_module=True) == ""


def test_notes_round_trip_and_an_earlier_runs_notes_are_cleared(tmp_path):
    from phalanx.runtime.context import mark_phalanx_created

    env = {"PHALANX_WORKER_NOTES": str(tmp_path / "workers")}
    for rank in (1, 0):
        worker_notes.write(WorkerNote(rank=rank, group_size=2, accelerate=True), env)
    mark_phalanx_created(env)
    directory = env["PHALANX_WORKER_NOTES"]
    assert worker_notes.read(directory) == [WorkerNote(0, 2, True), WorkerNote(1, 2, True)]
    assert worker_notes.phalanx_created(directory)
    worker_notes.clear(directory)
    assert worker_notes.read(directory) == [] and not worker_notes.phalanx_created(directory)
    worker_notes.write(WorkerNote(rank=0), {})  # not under phalanx run: nothing written, no error


def test_separate_worlds_are_named_only_when_a_rank_missed_the_group():
    joined = [WorkerNote(0, 2), WorkerNote(1, 2)]
    assert worker_notes.separate_worlds_line(joined, 2) is None
    assert worker_notes.separate_worlds_line([WorkerNote(0, None)], 1) is None
    line = worker_notes.separate_worlds_line([WorkerNote(0, 1), WorkerNote(1, None)], 2)
    assert line.startswith(
        "phalanx run: warning: ranks 0, 1 never joined a process group of 2: they ran as 2 separate worlds of one"
    )


def test_the_no_effect_line_lists_every_setting_the_script_could_not_get():
    given = settings(strategy="zero3", grad_accum_steps="4", mixed_precision="bf16", checkpoint_dir="/ck")
    plain = [WorkerNote(0, 2), WorkerNote(1, 2)]
    line = worker_notes.no_effect_line(plain, False, given, "dir/train.py", 0)
    assert line.startswith(
        "phalanx run: warning: --strategy zero3, --mixed-precision bf16, --grad-accum-steps 4 "
        "had no effect: train.py never created Phalanx()"
    )  # the launcher uses checkpoint_dir
    accelerate = [WorkerNote(0, 2, accelerate=True), WorkerNote(1, 2, accelerate=True)]
    assert worker_notes.no_effect_line(accelerate, False, given, "train.py", 0).startswith(
        "phalanx run: warning: --strategy zero3, --grad-accum-steps 4 had no effect"
    )  # precision reached it
    assert worker_notes.no_effect_line(accelerate, False, settings(strategy="zero3"), "train.py", 2) is None  # FSDP2
    assert worker_notes.no_effect_line(plain, True, given, "train.py", 0) is None  # a Phalanx() was created


def test_model_module_in_a_world_of_one_names_what_to_use(monkeypatch):
    from phalanx import Phalanx

    px = Phalanx()
    model = px.prepare(torch.nn.Linear(2, 2))
    assert not hasattr(model, "module")  # `getattr(model, "module", model)` and transformers' unwrap still work
    with pytest.raises(
        AttributeError,
        match=r"model.module: under .* its state_dict\(\) is the whole model.*"
        r"px.get_state_dict\(model\).*px.unwrap_model\(model\)",
    ):
        model.module  # noqa: B018 (the attribute access is what raises)
    with pytest.raises(AttributeError, match="no attribute 'other'"):
        model.other  # noqa: B018 (the attribute access is what raises)
    assert px.unwrap_model(model) is model and isinstance(model, torch.nn.Linear)
    assert list(px.get_state_dict(model)) == ["weight", "bias"]
    copied = copy.deepcopy(model)  # copied (and pickled) as the class it had
    assert type(copied) is torch.nn.Linear and torch.equal(copied.weight, model.weight)


def test_a_partial_state_of_the_scripts_own_without_accelerate_is_left_to_the_script(tmp_path, monkeypatch):
    from phalanx.launch import worker

    script = tmp_path / "own.py"
    script.write_text("class PartialState: ...\nstate = PartialState()\n")
    monkeypatch.setitem(__import__("sys").modules, "accelerate", None)  # not installed
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    worker.accelerate_on_cpu(str(script), is_module=False)  # no ImportError from the worker
