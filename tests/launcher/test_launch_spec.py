"""Pure validation of `phalanx run` input: no processes, no torch."""

import pytest

from phalanx.launch.spec import LaunchError, LaunchSpec, parse_gpus, validate


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_parse_gpus():
    assert parse_gpus("1,3") == (1, 3)
    assert parse_gpus(" 0 , 2") == (0, 2)
    for bad, message in [("a", "comma-separated"), ("0,,1", "comma-separated"), ("-1", ">= 0"), ("1,1", "twice")]:
        with pytest.raises(LaunchError, match=message):
            parse_gpus(bad)


def test_valid_spec_passes(script):
    spec = LaunchSpec(target=script, nproc_per_node=2)
    assert validate(spec) is spec and spec.single_node


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"node_rank": 2, "nnodes": 2, "master_addr": "h", "master_port": 1},
            r"--node-rank 2 is out of range for --nnodes 2",
        ),
        ({"gpus": (0, 1), "nproc_per_node": 4}, r"--nproc-per-node 4 conflicts with --gpus 0,1"),
        ({"nnodes": 2}, "needs the address of node 0"),
        ({"nnodes": 2, "master_addr": "h"}, "needs a fixed --master-port"),
    ],
)
def test_invalid_spec(script, changes, message):
    with pytest.raises(LaunchError, match=message):
        validate(LaunchSpec(target=script, **changes))


def test_missing_script_and_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError, match="training script 'nope.py' not found"):
        validate(LaunchSpec(target="nope.py"))
    with pytest.raises(LaunchError, match=r"module 'no_such_module_x' \(-m\) is not importable"):
        validate(LaunchSpec(target="no_such_module_x", is_module=True))
    (tmp_path / "mymod.py").write_text("")  # found in the working directory, like python -m
    validate(LaunchSpec(target="mymod", is_module=True))


def test_a_script_with_a_syntax_error_is_refused_once_before_launch(tmp_path, monkeypatch):
    """It reached every worker, each printing the same traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import torch\n\nfor x in range(3)\n    print(x)\n")
    with pytest.raises(
        LaunchError,
        match=r"training script 'broken.py' does not compile \(broken.py, line 3, "
        r"column 18\): expected ':': for x in range\(3\)\. HINT: fix it",
    ):
        validate(LaunchSpec(target="broken.py"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "0"], "--nnodes 0: expected N or MIN:MAX with 1 <= MIN <= MAX"),
        (["--max-restarts", "-1"], "--max-restarts -1: expected a whole number >= 0"),
        (["--master-port", "70000"], "--master-port 70000: expected a whole number in 1..65535"),
        (["--start-method", "thread"], "--start-method thread: choose one of auto, fork, spawn, forkserver"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0: expected a whole number >= 1, auto, gpu or cpu"),
        (["--rdzv-timeout", "0"], "--rdzv-timeout 0: expected a number of seconds > 0"),
    ],
)
def test_each_value_is_checked_once_by_its_schema_row(script, flags, message):
    """No second copy of these checks in LaunchSpec: the row's kind is the one place."""
    import argparse

    from phalanx.launch import run_command

    parser = argparse.ArgumentParser(prog="phalanx run")
    run_command.configure(parser)
    with pytest.raises(LaunchError, match=message):
        run_command.spec_from_args(parser.parse_args([*flags, script]))
