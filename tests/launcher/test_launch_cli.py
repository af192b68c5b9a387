"""Black-box runs of `python -m phalanx run`: each rank of record_env.py writes OUTDIR/rank{RANK}.json.

Each multi-process launch costs seconds, so assertions that belong to one launch are grouped.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.launcher.launch_helpers import RECORD_ENV, SCRIPTS, read_records, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]
RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
SCRIPT_ARGS = ["--lr", "3", "--nproc-per-node", "9", "-m", "x"]  # flag-like: must reach the script


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def _occupy(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError:  # someone else holds it: the point (29500 busy) holds anyway
        sock.close()
        return None
    return sock


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """One fork-mode launch with defaults, 29500 occupied, and every pass-through flag."""
    out_dir = tmp_path_factory.mktemp("default")
    ds_config = out_dir / "ds.json"
    ds_config.write_text("{}")
    blocker = _occupy(29500)
    try:
        result = run_cli(
            [
                "run",
                "--nproc-per-node",
                "2",
                "--strategy",
                "ddp",
                "--mixed_precision",
                "bf16",
                "--watchdog-timeout",
                "30",
                "--deepspeed",
                str(ds_config),
                "--grad-accum-steps",
                "4",
                str(RECORD_ENV),
                str(out_dir),
                *SCRIPT_ARGS,
            ],
            env={"OMP_NUM_THREADS": None},
        )
    finally:
        if blocker is not None:
            blocker.close()
    return result, read_records(out_dir), ds_config


def test_two_ranks_see_torchrun_env_and_untouched_args(default_run):
    result, records, ds_config = default_run
    assert result.returncode == 0, result.stderr
    assert sorted(records) == [0, 1]
    envs = [records[rank]["env"] for rank in (0, 1)]
    assert {(env["RANK"], env["LOCAL_RANK"]) for env in envs} == {("0", "0"), ("1", "1")}
    for record in records.values():
        env = record["env"]
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("2", "2", "0")
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] != "29500"  # it was busy; a free one was chosen
        assert record["argv"] == [str(RECORD_ENV), record["argv"][1], *SCRIPT_ARGS]
        assert record["name"] == "__main__" and record["world_size"] == 2
        assert env["PHALANX_STRATEGY"] == "ddp" and env["PHALANX_MIXED_PRECISION"] == "bf16"
        assert env["PHALANX_WATCHDOG_TIMEOUT"] == "30" and env["PHALANX_DEEPSPEED_CONFIG"] == str(ds_config)
        assert env["PHALANX_GRAD_ACCUM_STEPS"] == "4"
        # An equal share of the cores, and torch in the worker really uses it.
        from phalanx.launch.devices import count_cpu_cores

        share = str(max(1, count_cpu_cores() // 2))
        assert env["OMP_NUM_THREADS"] == share and record["num_threads"] == int(share)
    assert len({record["env"]["MASTER_PORT"] for record in records.values()}) == 1


def test_same_env_keys_as_torchrun(default_run, out_dir):
    _, records, _ = default_run
    result = run_cli(
        ["--nproc-per-node", "2", str(RECORD_ENV), str(out_dir)],
        module="torch.distributed.run",
        env={"OMP_NUM_THREADS": None},
    )
    assert result.returncode == 0, result.stderr
    torchrun = read_records(out_dir)

    def without_phalanx_settings(keys):  # the phalanx run above exported its own PHALANX_* flags, and
        # what `accelerate launch` and `fabric run` would set for their scripts (launch/framework_env.py)
        return {k for k in keys if not k.startswith(("PHALANX_", "ACCELERATE_", "LT_"))}

    assert {k: v for k, v in records[1]["env"].items() if k.startswith("ACCELERATE_")} == {  # as accelerate launch
        "ACCELERATE_USE_CPU": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    assert {k for k in records[1]["env_keys"] if k.startswith("LT_")} == {  # as fabric run
        "LT_CLI_USED",
        "LT_ACCELERATOR",
        "LT_DEVICES",
        "LT_NUM_NODES",
        "LT_PRECISION",
    }

    assert without_phalanx_settings(records[1]["env_keys"]) == without_phalanx_settings(torchrun[1]["env_keys"])
    for rank in (0, 1):
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            assert records[rank]["env"][key] == torchrun[rank]["env"][key]


def test_spawn_module_mode_explicit_port_and_user_omp(out_dir):
    with socket.socket() as sock:  # a port that is free now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run_cli(
        [
            "run",
            "--start_method",
            "spawn",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "recmod",
            str(out_dir),
            "--flag",
        ],
        cwd=SCRIPTS,
        env={"OMP_NUM_THREADS": "2"},
    )
    assert result.returncode == 0, result.stderr
    records = read_records(out_dir)
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert record["env"]["MASTER_PORT"] == str(port) and record["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert record["env"]["OMP_NUM_THREADS"] == "2"  # the user's value is kept
        assert record["module_argv0"].endswith("recmod/__main__.py") and record["module_name"] == "__main__"
        assert record["argv"][1:] == [str(out_dir), "--flag"]


def test_failing_worker_names_rank_and_traceback():
    result = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / "fail_rank1.py")])
    assert result.returncode != 0
    assert "phalanx: rank 1 (local rank 1 on node 0) failed with exit code 1" in result.stderr
    summary = result.stderr[result.stderr.index("phalanx: rank 1") :]
    lines = (SCRIPTS / "fail_rank1.py").read_text().splitlines()
    raise_line = next(number for number, line in enumerate(lines, 1) if "raise RuntimeError" in line)
    assert f'fail_rank1.py", line {raise_line}, in <module>' in summary
    assert "RuntimeError: deliberate failure on rank one" in summary
    assert "phalanx/launch/worker.py" not in summary  # the wrapper's frames are trimmed


BAD_INPUTS = [
    (["nope.py"], "phalanx run: error: training script 'nope.py' not found"),
    (["-m", "no_such_module_x"], "phalanx run: error: module 'no_such_module_x' (-m) is not importable"),
    (
        ["--nproc-per-node", "0", "{script}"],
        "phalanx run: error: --nproc-per-node 0: expected a whole number >= 1, auto, gpu or cpu",
    ),
    (
        ["--nproc-per-node", "-1", "{script}"],
        "phalanx run: error: --nproc-per-node -1: expected a whole number >= 1, auto, gpu or cpu",
    ),
    (
        ["--nproc_per_node", "two", "{script}"],
        "phalanx run: error: --nproc-per-node two: expected a whole number >= 1, auto, gpu or cpu",
    ),
    (
        ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1", "{script}"],
        "phalanx run: error: --node-rank 2 is out of range for --nnodes 2",
    ),
    (
        ["--bogus", "3", "{script}"],
        "phalanx run: error: unrecognized arguments: --bogus. phalanx run's own flags go before the script",
    ),
    (["--nproc", "2", "{script}"], "phalanx run: error: unrecognized arguments: --nproc."),
    (
        ["--nproc-per-node", "4", "--gpus", "0,1", "{script}"],
        "phalanx run: error: --nproc-per-node 4 conflicts with --gpus 0,1",
    ),
    (["--gpus", "0", "{script}"], "phalanx run: error: --gpus names GPU 0, but this machine has 0 visible GPU(s)"),
    (["--grad-accum-steps", "0", "{script}"], "phalanx run: error: --grad-accum-steps 0: expected a whole number >= 1"),
    (
        ["--watchdog-timeout", "-5", "{script}"],
        "phalanx run: error: --watchdog-timeout -5: expected a number of seconds >= 0 (0 turns it off)",
    ),
    (["--deepspeed", "missing.json", "{script}"], "phalanx run: error: --deepspeed missing.json: file not found"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), BAD_INPUTS, ids=[" ".join(a[:2]) for a, _ in BAD_INPUTS])
def test_bad_input_fails_fast_without_spawning(args, message, out_dir):
    if "--gpus" in args and "0,1" not in args and _has_gpu():
        pytest.skip("this machine has a GPU 0")
    args = [str(RECORD_ENV) if arg == "{script}" else arg for arg in args]
    result = run_cli(["run", *args, str(out_dir)], timeout=30)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    # (No wall-clock bound: one of 15 s failed at 16.3 s on a loaded machine. The checks run before
    # any worker starts, which the empty out_dir shows.)
    assert not list(out_dir.iterdir())  # no worker ran


@pytest.mark.timeout(60)
def test_busy_explicit_port_and_conflicting_cuda_visible_devices(out_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli(["run", "--master-port", str(port), str(RECORD_ENV), str(out_dir)], timeout=30)
    assert result.returncode == 2
    assert (
        f"phalanx run: error: --master-port {port} is already in use on this machine. HINT: omit --master-port"
        in result.stderr
    )
    result = run_cli(
        ["run", "--gpus", "0", str(RECORD_ENV), str(out_dir)], env={"CUDA_VISIBLE_DEVICES": "1"}, timeout=30
    )
    assert result.returncode == 2
    assert "phalanx run: error: --gpus 0 conflicts with CUDA_VISIBLE_DEVICES='1'" in result.stderr
    assert not list(out_dir.iterdir())


def _has_gpu() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None
