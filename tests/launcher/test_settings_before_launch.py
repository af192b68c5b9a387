"""A bad setting from any of the four sources (flag, PHALANX_* variable, YAML file, DeepSpeed JSON)
stops `phalanx run` with exit 2 and one message naming the source, the value and the valid ones,
before any worker starts: the script never runs."""

import json

import pytest

from tests.launcher.launch_helpers import run_cli

SCRIPT = "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n"
CHOICES = "choose one of dp, ddp, zero1, zero2, zero3, fsdp, auto"


def _case(tmp_path, source):
    """(extra flags, env, expected message) for one source of a bad strategy."""
    if source == "flag":
        return ["--strategy", "zero4"], {}, f"--strategy zero4: {CHOICES}"
    if source == "env":
        return [], {"PHALANX_STRATEGY": "zero4"}, f"PHALANX_STRATEGY=zero4: {CHOICES}"
    if source == "yaml":
        path = tmp_path / "phalanx.yaml"
        path.write_text("strategy: zero4\n")
        return ["--config", str(path)], {}, f"{path}: strategy: zero4: {CHOICES}"
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})
    )
    return (
        ["--deepspeed", str(path), "--nproc-per-node", "2"],
        {},
        f"DeepSpeed config '{path}': train_batch_size=7 but train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x world_size=2 = 4",
    )


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["flag", "env", "yaml", "deepspeed"])
def test_bad_setting_from_each_source_is_refused_before_any_worker(tmp_path, source):
    script, marker = tmp_path / "train.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT)
    flags, env, message = _case(tmp_path, source)
    result = run_cli(["run", *flags, str(script), str(marker)], env=env, timeout=45)
    assert result.returncode == 2, result.stderr
    assert f"phalanx run: error: {message}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # one message, no traceback
    assert not marker.exists()  # the script never ran


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_deepspeed_contradicting_a_flag_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = run_cli(
        ["run", "--deepspeed", str(path), "--strategy", "zero3", str(script), str(tmp_path / "m")], timeout=45
    )
    assert result.returncode == 2
    assert f"strategy='zero3' was given by --strategy but the DeepSpeed config '{path}' says 'zero2'" in result.stderr
