"""Config files: schema checks, precedence file < env < flag for `phalanx run` and Phalanx.from_config."""
import os

import pytest
import yaml

from phalanx import Phalanx, cli, config, envvars
from phalanx.launch.run_command import spec_from_args
from phalanx.launch.spec import LaunchError

RUNTIME_VARS = [s.env for s in config.SETTINGS if s.env]


@pytest.fixture(autouse=True)
def clean_phalanx_env():
    """No PHALANX_* setting from the outer environment; from_config's exports are undone after each test."""
    saved = dict(os.environ)
    for var in RUNTIME_VARS:
        if var != envvars.PHALANX_RUN_DIR:
            os.environ.pop(var, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def launch_spec(argv):
    return spec_from_args(cli.build_parser().parse_args(["run", *argv]))


# ---- the schema ------------------------------------------------------------------------------
def test_schema_names_every_setting_of_the_issue_with_its_variable():
    expected = {"nproc_per_node": None, "nnodes": None, "strategy": envvars.PHALANX_STRATEGY,
                "mixed_precision": envvars.PHALANX_MIXED_PRECISION, "grad_accum_steps": envvars.PHALANX_GRAD_ACCUM_STEPS,
                "checkpoint_dir": envvars.PHALANX_CHECKPOINT_DIR, "watchdog_timeout": envvars.PHALANX_WATCHDOG_TIMEOUT}
    for name, env in expected.items():
        assert config.BY_NAME[name].env == env, name
    assert all(getattr(envvars, s.env) == s.env for s in config.SETTINGS if s.env)  # named in envvars.py
    # every phalanx setting variable has its config key (PHALANX_SLURM is a launcher switch, not a setting)
    variables = {v for k, v in vars(envvars).items() if k.startswith("PHALANX_")} - {envvars.PHALANX_SLURM}
    assert variables == {s.env for s in config.SETTINGS if s.env}


def test_unknown_keys_are_rejected_listing_the_valid_ones(tmp_path):
    path = write(tmp_path, "strategy: ddp\nnproc: 2\nlearning_rate: 3\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert "unknown key(s) 'nproc', 'learning_rate'" in message
    assert "Valid keys: " + ", ".join(config.valid_keys()) in message
    assert "nproc_per_node" in message and "watchdog_timeout" in message


@pytest.mark.parametrize("text, fragment", [
    ("grad_accum_steps: 0", "grad_accum_steps: invalid value 0: must be at least 1"),
    ("watchdog_timeout: -5", "watchdog_timeout: invalid value -5: must be >= 0 (0 = off)"),
    ("collective_timeout: 0", "collective_timeout: invalid value 0: must be a positive number"),
    ("nproc_per_node: two", "nproc_per_node: invalid value 'two': must be a positive integer or 'auto'"),
    ("log_level: LOUD", "log_level: invalid value 'LOUD': must be one of DEBUG, INFO, WARNING, ERROR"),
    ("max_restarts: true", "max_restarts: invalid value True"),
    ("- strategy", "expected a mapping of settings at the top level, got list"),
])
def test_bad_values_name_key_and_value(tmp_path, text, fragment):
    with pytest.raises(config.ConfigError, match=None) as info:
        config.load(write(tmp_path, text))
    assert fragment in str(info.value)


def test_relative_paths_are_relative_to_the_file(tmp_path):
    values = config.load(write(tmp_path, "checkpoint_dir: ckpt\nlog_sinks: [csv]\n"))
    assert values == {"checkpoint_dir": str(tmp_path / "ckpt"), "log_sinks": ["csv"]}


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(config.ConfigError, match="not found. HINT: `phalanx config"):
        config.load(tmp_path / "nope.yaml")


def test_resolve_precedence_file_then_env_then_flag():
    file_values = {"strategy": "dp", "mixed_precision": "bf16", "grad_accum_steps": 2}
    env = {envvars.PHALANX_STRATEGY: "zero1", envvars.PHALANX_MIXED_PRECISION: "fp16"}
    merged = config.resolve(file_values, env, {"strategy": "ddp", "mixed_precision": None})
    assert (merged.strategy, merged.mixed_precision, merged.grad_accum_steps) == ("ddp", "fp16", 2)
    assert config.runtime_env(merged) == {envvars.PHALANX_STRATEGY: "ddp", envvars.PHALANX_MIXED_PRECISION: "fp16",
                                          envvars.PHALANX_GRAD_ACCUM_STEPS: "2"}


# ---- phalanx config (starter file) -------------------------------------------------------------
def test_starter_file_lists_every_key_and_loads_once_uncommented(tmp_path):
    path = tmp_path / "phalanx.yaml"
    assert cli.main(["config", str(path)]) == 0
    text = path.read_text()
    assert yaml.safe_load(text) is None  # everything commented out: a no-op file
    assert config.load(path) == {}
    for s in config.SETTINGS:
        assert f"# {s.name}: " in text
    uncommented = "\n".join(line[2:] for line in text.splitlines() if line.startswith(("# ", "#")) and ": " in line
                            and line[2:].split(":")[0] in config.BY_NAME)
    values = config.load(write(tmp_path, uncommented, "all.yaml"))
    assert set(values) == set(config.valid_keys())
    assert cli.main(["config", str(path)]) == 2  # refuses to overwrite without --force
    assert cli.main(["config", str(path), "--force"]) == 0


# ---- phalanx run --config (no processes: the parsed spec) -------------------------------------
def test_run_flags_default_as_before_without_a_config(script):
    spec = launch_spec([script])
    assert (spec.nproc_per_node, spec.nnodes, spec.max_restarts, spec.start_method) == (None, 1, 0, "auto")
    assert spec.worker_env == {}


def test_run_config_fills_launcher_and_runtime_settings(tmp_path, script):
    path = write(tmp_path, "nproc_per_node: 3\nmax_restarts: 2\nstrategy: dp\nwatchdog_timeout: 60\n"
                           "grad_accum_steps: 4\ncheckpoint_dir: ckpt\nnnodes: 1:2\nrdzv_backend: c10d\n"
                           "rdzv_endpoint: 127.0.0.1:29400\nrdzv_timeout: 15\n")
    spec = launch_spec(["--config", path, script])
    assert (spec.nproc_per_node, spec.max_restarts) == (3, 2)
    assert (spec.min_nnodes, spec.nnodes, spec.rdzv_backend, spec.rdzv_endpoint, spec.rdzv_timeout) == (
        1, 2, "c10d", "127.0.0.1:29400", 15.0)
    assert spec.worker_env == {envvars.PHALANX_STRATEGY: "dp", envvars.PHALANX_WATCHDOG_TIMEOUT: "60.0",
                               envvars.PHALANX_GRAD_ACCUM_STEPS: "4",
                               envvars.PHALANX_CHECKPOINT_DIR: str(tmp_path / "ckpt")}


def test_run_precedence_file_lt_env_lt_flag(tmp_path, script, monkeypatch):
    path = write(tmp_path, "nproc_per_node: 3\nstrategy: dp\nmixed_precision: bf16\ngrad_accum_steps: 4\n")
    monkeypatch.setenv(envvars.PHALANX_STRATEGY, "zero1")
    monkeypatch.setenv(envvars.PHALANX_GRAD_ACCUM_STEPS, "8")
    spec = launch_spec(["--config", path, "--nproc-per-node", "2", "--mixed-precision", "fp16", script])
    assert spec.nproc_per_node == 2  # flag over file
    # env over file: the launcher does not export the file's value; workers inherit the env's
    assert envvars.PHALANX_STRATEGY not in spec.worker_env
    assert envvars.PHALANX_GRAD_ACCUM_STEPS not in spec.worker_env
    assert spec.worker_env == {envvars.PHALANX_MIXED_PRECISION: "fp16"}  # flag over file
    spec = launch_spec(["--config", path, "--strategy", "ddp", script])
    assert spec.worker_env[envvars.PHALANX_STRATEGY] == "ddp"  # flag over env


def test_run_config_errors_are_launch_errors(tmp_path, script):
    with pytest.raises(LaunchError, match="unknown key.*'procs'.*Valid keys: nproc_per_node"):
        launch_spec(["--config", write(tmp_path, "procs: 2\n"), script])
    with pytest.raises(LaunchError, match="deepspeed: file .* not found"):
        launch_spec(["--config", write(tmp_path, "deepspeed: missing.json\n"), script])


def test_run_config_error_exits_2_before_launching(tmp_path, script, capsys):
    assert cli.main(["run", "--config", write(tmp_path, "procs: 2\n"), script]) == 2
    assert "phalanx run: error:" in capsys.readouterr().err


# ---- Phalanx.from_config (world of one) -------------------------------------------------------
def test_from_config_precedence_and_pass_through(tmp_path, monkeypatch):
    import logging

    path = write(tmp_path, "nproc_per_node: 4\nstrategy: ddp\nseed: 7\ncollective_timeout: 30\n"
                           "grad_accum_steps: 3\nlog_level: DEBUG\nlog_sinks: [jsonl]\n")
    monkeypatch.setenv(envvars.PHALANX_SEED, "11")
    monkeypatch.setenv(envvars.PHALANX_LOG_LEVEL, "WARNING")
    px = Phalanx.from_config(path)
    assert px.strategy_name == "single"  # ddp in a world of one
    assert px.seed == 11  # env over file (a Phalanx() argument)
    assert logging.getLogger("phalanx").level == logging.WARNING  # env over file (read from the env)
    assert px.settings.grad_accum_steps == 3  # file (a Phalanx() argument)
    assert os.environ[envvars.PHALANX_LOG_SINKS] == "jsonl"  # no Phalanx() argument: passed on as env
    px = Phalanx.from_config(path, seed=5, grad_accum_steps=6, log_level="INFO")
    assert (px.seed, px.settings.grad_accum_steps) == (5, 6)  # keywords over env and file
    assert logging.getLogger("phalanx").level == logging.INFO
    with pytest.raises(config.ConfigError, match="unknown key"):
        Phalanx.from_config(write(tmp_path, "stratgy: ddp\n", "typo.yaml"))


def test_yaml_words_no_and_off_are_not_booleans_here(tmp_path):
    values = config.load(write(tmp_path, "mixed_precision: no\nprogress: off\nlog_all_ranks: yes\n"))
    assert values == {"mixed_precision": "no", "progress": "off", "log_all_ranks": True}


def test_yaml_base_60_integers_are_not_read(tmp_path):
    values = config.load(write(tmp_path, "nnodes: 1:2\nnproc_per_node: 4\nmaster_port: 0x7530\n"))
    assert values == {"nnodes": "1:2", "nproc_per_node": 4, "master_port": 30000}
