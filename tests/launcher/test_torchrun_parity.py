"""`phalanx run` accepts every flag of the pinned torch's torchrun, both spellings, and its PET_* variables.

The list comes from torch's own parser (torch.distributed.run.get_args_parser), so a flag a new torch
adds fails here until phalanx maps or refuses it. No processes are started.
"""

import argparse
import os

import pytest
from torch.distributed.argparse_util import check_env, env
from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.run import get_args_parser

from phalanx.launch import agent, run_command, torchrun_flags
from phalanx.launch.spec import LaunchError


def _torch_actions():
    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def _phalanx_parser():
    parser = argparse.ArgumentParser()
    run_command.configure(parser)
    return parser


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith(("PET_", "SLURM_")):
            monkeypatch.delenv(key)
    (tmp_path / "train.py").write_text("")
    return "train.py"


def test_every_torchrun_option_string_is_a_phalanx_run_flag_with_torchs_dest():
    ours = _phalanx_parser()._option_string_actions
    torch_dests = set()
    for action in _torch_actions():
        torch_dests.add(action.dest)
        if action.dest in torchrun_flags.REFUSED:
            continue
        for option in action.option_strings:
            assert option in ours, f"torchrun's {option} is not a phalanx run flag"
            assert ours[option].dest == action.dest, option  # same dest: same PET_<DEST> name
            assert (ours[option].nargs == 0) == (action.nargs == 0), f"{option}: switch in one, value in the other"
    assert torch_dests == set(torchrun_flags.BY_DEST) | set(torchrun_flags.REFUSED)
    assert not set(torchrun_flags.BY_DEST) & set(torchrun_flags.REFUSED)


def test_pet_variables_are_read_exactly_for_torchruns_env_flags():
    for action in _torch_actions():
        flag = torchrun_flags.BY_DEST[action.dest]
        assert flag.pet == isinstance(action, (env, check_env)), action.dest
        assert flag.switch == isinstance(action, check_env) or action.dest == "module" and flag.switch


def test_every_added_flag_in_underscore_spelling_reaches_the_launch_config(script):
    argv = [
        "--rdzv_conf",
        "join_timeout=7,x=y",
        "--monitor_interval",
        "0.5",
        "--event_log_handler",
        "console",
        "--role",
        "trainer",
        "--log_dir",
        "logs",
        "-r",
        "1",
        "--tee",
        "0:3,1:2",
        "--local_ranks_filter",
        "0",
        "--duplicate_stdout_filters",
        "loss,acc",
        "--local_addr",
        "10.0.0.5",
        "--signals_to_handle",
        "SIGTERM",
        "--shutdown_timeout",
        "9",
        "--virtual_local_rank",
        "--run_path",
        "--nproc_per_node",
        "2",
        script,
    ]
    spec = run_command.spec_from_args(_phalanx_parser().parse_args(argv))
    options = spec.agent
    assert (options.rdzv_conf, options.monitor_interval, options.event_log_handler, options.role) == (
        {"join_timeout": "7", "x": "y"},
        0.5,
        "console",
        "trainer",
    )
    assert (options.log_dir, options.redirects, options.tee, options.local_ranks_filter) == (
        "logs",
        "1",
        "0:3,1:2",
        (0,),
    )
    assert (options.duplicate_stdout_filters, options.local_addr, options.shutdown_timeout) == (
        ("loss", "acc"),
        "10.0.0.5",
        9,
    )
    assert options.virtual_local_rank and options.run_path and not options.no_python
    kwargs = torchrun_flags.launch_config_kwargs(options)
    logs = kwargs["logs_specs"]
    assert (logs._redirects, logs._tee, logs._local_ranks_filter) == (Std.OUT, {0: Std.ALL, 1: Std.ERR}, {0})
    assert (kwargs["role"], kwargs["monitor_interval"], kwargs["signals_to_handle"]) == ("trainer", 0.5, "SIGTERM")
    assert kwargs["duplicate_stdout_filters"] == ["loss", "acc"] and kwargs["virtual_local_rank"] is True
    settings = agent.rendezvous_settings(spec)
    assert settings["rdzv_configs"] == {"rank": 0, "join_timeout": "7", "x": "y"}
    assert settings["local_addr"] == "10.0.0.5"
    assert agent.entrypoint_for(spec, "spawn")[0].__name__ == "run_in_process"  # --run-path: runpy in the worker


def test_kubeflow_pet_variables_fill_what_the_command_line_left_out(script, monkeypatch):
    for key, value in {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "3",
        "PET_MASTER_ADDR": "trainer-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_TEE": "3",
        "PET_STANDALONE": "0",
        "PET_MODULE": "0",
    }.items():
        monkeypatch.setenv(key, value)
    spec = run_command.spec_from_args(_phalanx_parser().parse_args(["--node-rank", "0", script]))
    assert (spec.nnodes, spec.node_rank, spec.nproc_per_node) == (2, 0, 3)  # the flag beats PET_NODE_RANK
    assert (spec.master_addr, spec.master_port, spec.agent.tee, spec.is_module) == (
        "trainer-master-0",
        23456,
        "3",
        False,
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("PET_NODE_RANK", "one", r"PET_NODE_RANK='one' is not valid for --node-rank: expected a whole number >= 0\."),
        (
            "PET_NPROC_PER_NODE",
            "0",
            r"PET_NPROC_PER_NODE='0' is not valid for --nproc-per-node: expected a whole number >= 1, auto, gpu or cpu\.",
        ),
        ("PET_NNODES", "2:1", r"PET_NNODES='2:1' is not valid for --nnodes"),
        ("PET_MASTER_PORT", "http", r"PET_MASTER_PORT='http' is not valid for --master-port"),
        ("PET_MAX_RESTARTS", "x", r"PET_MAX_RESTARTS='x' is not valid for --max-restarts"),
        ("PET_START_METHOD", "thread", r"PET_START_METHOD='thread' is not valid for --start-method"),
        ("PET_TEE", "7", r"PET_TEE='7' is not valid for --tee: must be 0 \(none\), 1 \(stdout\)"),
        ("PET_REDIRECTS", "0:4", r"PET_REDIRECTS='0:4' is not valid for --redirects"),
        ("PET_MONITOR_INTERVAL", "soon", r"PET_MONITOR_INTERVAL='soon' is not valid for --monitor-interval"),
        ("PET_RDZV_CONF", "timeout", r"PET_RDZV_CONF='timeout' is not valid for --rdzv-conf: must be KEY=VALUE"),
        ("PET_LOCAL_RANKS_FILTER", "a", r"PET_LOCAL_RANKS_FILTER='a' is not valid for --local-ranks-filter"),
        ("PET_SIGNALS_TO_HANDLE", "SIGNOPE", r"PET_SIGNALS_TO_HANDLE='SIGNOPE' is not valid for --signals-to-handle"),
        ("PET_STANDALONE", "yes", r"PET_STANDALONE='yes' is not valid for --standalone: must be 0 or 1"),
        ("PET_SHUTDOWN_TIMEOUT", "1.5", r"PET_SHUTDOWN_TIMEOUT='1.5' is not valid for --shutdown-timeout"),
    ],
)
def test_pet_values_torchrun_rejects_are_errors_naming_the_variable(script, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=message + r".*HINT: fix or unset " + name):
        run_command.spec_from_args(_phalanx_parser().parse_args([script]))


@pytest.mark.parametrize(
    "name, value",
    [
        ("PET_NODE_RANK", "one"),
        ("PET_MASTER_PORT", "http"),
        ("PET_MAX_RESTARTS", "x"),
        ("PET_MONITOR_INTERVAL", "soon"),
        ("PET_STANDALONE", "yes"),
    ],
)
def test_torchrun_rejects_the_same_pet_values(monkeypatch, name, value):
    """The values refused above are refused by torchrun's own parser too (not stricter than torch).

    (A PET_START_METHOD outside the choices passes torch's parser, which leaves defaults unchecked,
    and fails later when the agent starts workers; phalanx refuses it up front.)
    """
    monkeypatch.setenv(name, value)
    with pytest.raises((SystemExit, ValueError)):
        get_args_parser().parse_args(["train.py"])


def test_torchrun_rejects_the_same_stream_specs():
    for text in ("7", "0:4", "x"):
        with pytest.raises(ValueError):
            Std.from_str(text)
        with pytest.raises(argparse.ArgumentTypeError):
            torchrun_flags.std_spec(text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--standalone", "--nnodes", "2"], "--standalone runs a single node, but --nnodes is 2"),
        (["--no-python", "-m"], "--no-python and -m/--module cannot be combined"),
        (["--no-python", "--run-path"], "--no-python and --run-path cannot be combined"),
        (["--no-python"], r"--no-python runs 'train.py' as a program, but it is not an executable file"),
        (
            ["--nproc-per-node", "2", "--local-ranks-filter", "0,3"],
            r"--local-ranks-filter names local rank\(s\) 3, but this node runs 2",
        ),
        (
            ["--pass-local-rank=local_rank"],
            r"--pass-local-rank takes the flag name the script expects.*got 'local_rank'",
        ),
    ],
)
def test_contradictions_are_refused_before_anything_starts(script, argv, message):
    with pytest.raises(LaunchError, match=message):
        run_command.spec_from_args(_phalanx_parser().parse_args([*argv, script]))


def test_pass_local_rank_before_the_script_takes_no_value_from_it(script):
    bare = run_command.spec_from_args(_phalanx_parser().parse_args(["--pass-local-rank", script, "--pass-local-rank"]))
    assert (bare.pass_local_rank, bare.target, bare.target_args) == ("--local-rank", script, ("--pass-local-rank",))
    old = run_command.spec_from_args(
        _phalanx_parser().parse_args(["--pass-local-rank=--local_rank", script, "--lr", "1"])
    )
    assert old.pass_local_rank == "--local_rank"
    assert agent.entrypoint_for(old, "spawn")[1][-3:] == ["--local_rank=${local_rank}", "--lr", "1"]


def test_standalone_and_single_node_c10d_use_the_loopback_only_store(script):
    standalone = run_command.spec_from_args(_phalanx_parser().parse_args(["--standalone", script]))
    c10d = run_command.spec_from_args(
        _phalanx_parser().parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29411", script])
    )
    for spec, endpoint in ((standalone, "127.0.0.1:0"), (c10d, "127.0.0.1:29411")):
        settings = agent.rendezvous_settings(spec)
        assert (settings["rdzv_backend"], settings["rdzv_endpoint"], settings["local_addr"]) == (
            "phalanx-static",
            endpoint,
            "127.0.0.1",
        )
