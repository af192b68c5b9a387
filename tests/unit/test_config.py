"""The settings schema: every row reaches every surface (flag, env, YAML, Phalanx() argument, template)
with the same default and choices; precedence; bad values named with their source."""

import inspect
import os

import pytest
import yaml

from phalanx import Phalanx, cli, config
from phalanx.launch.run_command import spec_from_args
from phalanx.launch.spec import LaunchError


@pytest.fixture(autouse=True)
def no_phalanx_env(monkeypatch, tmp_path):
    """Only what a test sets: no PHALANX_* variable from outside (runs/ goes under tmp_path)."""
    for name in [k for k in os.environ if k.startswith("PHALANX_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


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


def values(layer):
    return {name: value for name, (value, _) in layer.items()}


def run_help() -> str:
    parser = cli.build_parser()
    run = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    return run.format_help()


def _text_form(setting, value):
    """How a user would type `value` for this setting on a command line or in an env variable."""
    return config.to_env_value(value)


# ---- the schema reaches every surface -------------------------------------------------------------
def test_every_setting_reaches_every_surface_with_the_same_default():
    help_text = " ".join(run_help().split())
    template = config.template_text()
    template_values = yaml.safe_load(
        "\n".join(
            line[2:]
            for line in template.splitlines()
            if line.startswith("# ") and line[2:].split(":")[0] in config.BY_NAME
        )
    )
    signature = inspect.signature(Phalanx).parameters
    defaults = config.resolve().config
    for s in config.SETTINGS:
        # flag: both spellings, with the default shown as a user would type it
        for flag in s.flags:
            assert flag in help_text, s.name
        if s.default not in (None, ""):
            shown = str(s.default).lower() if isinstance(s.default, bool) else _text_form(s, s.default)
            assert f"(default {shown}" in help_text, s.name
        # template: the default, and it parses back to the same value
        assert f"# {s.name}: " in template, s.name
        assert template_values[s.name] == s.default or s.default is None and template_values[s.name] is None, s.name
        assert getattr(defaults, s.name) == s.default, s.name
        if s.scope != config.Scope.RUNTIME:
            # a launcher setting has a variable only where its row names one (PHALANX_DASHBOARD)
            assert s.env == s.env_name and s.name not in signature, s.name
            if s.env:
                assert values(config.from_env({s.env: "8765"})) == {s.name: s.kind.from_text("8765")}, s.name
            continue
        # Phalanx() argument; env variable carrying the default's text form gives the default back
        assert s.name in signature and signature[s.name].default is None, s.name
        assert s.env == ("PHALANX_DEEPSPEED_CONFIG" if s.name == "deepspeed" else f"PHALANX_{s.name.upper()}")
        if s.default is not None:
            text = _text_form(s, s.default)
            assert values(config.from_env({s.env: text})) == {s.name: s.default}, s.name
            assert values(config.from_flags({s.name: s.default if s.bool_flag else text})) == {s.name: s.default}
            assert values(config.from_kwargs({s.name: s.default})) == {s.name: s.default}, s.name
            assert values(config.from_mapping({s.name: s.default}, "f.yaml")) == {s.name: s.default}, s.name


def _choices(setting):
    return list(setting.kind.choices()) if setting.kind.choices else None


def test_every_choice_is_accepted_by_every_source_and_the_same_list_is_offered():
    for s in config.SETTINGS:
        choices = _choices(s)
        if choices is None:
            continue
        assert choices, s.name
        for choice in choices:
            got = {
                values(config.from_flags({s.name: choice}))[s.name],
                values(config.from_mapping({s.name: choice}, "f.yaml"))[s.name],
            }
            if s.env:
                got |= {
                    values(config.from_env({s.env: choice}))[s.name],
                    values(config.from_kwargs({s.name: choice}))[s.name],
                }
            assert len(got) == 1, (s.name, choice, got)
        listed = f"choose one of {', '.join(choices)}"
        sources = [
            lambda s=s: config.from_flags({s.name: "bogus"}),
            lambda s=s: config.from_mapping({s.name: "bogus"}, "f.yaml"),
        ]
        if s.env:
            sources += [
                lambda s=s: config.from_env({s.env: "bogus"}),
                lambda s=s: config.from_kwargs({s.name: "bogus"}),
            ]
        for source in sources:
            with pytest.raises(config.ConfigError, match=listed):
                source()


def test_strategy_choices_are_the_presets_and_their_aliases():
    from phalanx.config.names import STRATEGY_ALIASES
    from phalanx.strategies.plan import presets

    assert set(_choices(config.BY_NAME["strategy"])) == {*presets.PRESETS, *STRATEGY_ALIASES, presets.AUTO}


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: config.from_flags({"strategy": "zero4"}),
            "--strategy zero4: choose one of dp, ddp, zero1, zero2, zero3, fsdp, auto",
        ),
        (
            lambda: config.from_env({"PHALANX_MIXED_PRECISION": "fp8"}),
            "PHALANX_MIXED_PRECISION=fp8: choose one of no, bf16, fp16",
        ),
        (
            lambda: config.from_mapping({"strategy": "zero4"}, "phalanx.yaml"),
            "phalanx.yaml: strategy: zero4: choose one of dp, ddp",
        ),
        (
            lambda: config.from_kwargs({"grad_accum_steps": 0}),
            "Phalanx(grad_accum_steps=0): expected a whole number >= 1",
        ),
        (
            lambda: config.from_flags({"watchdog_timeout": "-5"}),
            "--watchdog-timeout -5: expected a number of seconds >= 0",
        ),
        (
            lambda: config.from_env({"PHALANX_COLLECTIVE_TIMEOUT": "0"}),
            "PHALANX_COLLECTIVE_TIMEOUT=0: expected a number of seconds > 0",
        ),
        (
            lambda: config.from_mapping({"max_restarts": True}, "f.yaml"),
            "f.yaml: max_restarts: True: expected a whole number >= 0",
        ),
        (
            lambda: config.from_mapping({"log_level": "LOUD"}, "f.yaml"),
            "f.yaml: log_level: LOUD: choose one of DEBUG, INFO",
        ),
        (
            lambda: config.from_mapping({"log_sinks": ["csv", "paper"]}, "f.yaml"),
            "unknown name(s) paper; choose from auto, csv",
        ),
        (lambda: config.from_mapping({"memory_budget": "lots"}, "f.yaml"), "expected a size such as 8GB"),
        (
            lambda: config.from_mapping(["strategy"], "f.yaml"),
            "expected a mapping of settings at the top level, got list",
        ),
    ],
)
def test_bad_values_name_source_value_and_fix(make, message):
    with pytest.raises(config.ConfigError) as info:
        make()
    assert message in str(info.value)


def test_unknown_keys_and_arguments_list_the_valid_ones(tmp_path):
    with pytest.raises(config.ConfigError) as info:
        config.from_yaml(write(tmp_path, "strategy: ddp\nnproc: 2\nlearning_rate: 3\n"))
    assert "unknown key(s) 'nproc', 'learning_rate'" in str(info.value)
    assert "Valid keys: " + ", ".join(config.valid_keys()) in str(info.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stratgy'. Valid settings: strategy, "):
        Phalanx(stratgy="ddp")


def test_relative_paths_are_relative_to_the_file_and_missing_files_say_how_to_make_one(tmp_path):
    layer = config.from_yaml(write(tmp_path, "checkpoint_dir: ckpt\nlog_sinks: [csv]\n"))
    assert values(layer) == {"checkpoint_dir": str(tmp_path / "ckpt"), "log_sinks": ["csv"]}
    with pytest.raises(config.ConfigError, match="not found. HINT: `phalanx config"):
        config.from_yaml(tmp_path / "nope.yaml")


def test_precedence_kwarg_over_flag_and_env_over_file_over_default():
    file_layer = config.from_mapping({"strategy": "dp", "mixed_precision": "bf16", "grad_accum_steps": 2}, "f.yaml")
    env_layer = config.from_env({"PHALANX_STRATEGY": "zero1", "PHALANX_MIXED_PRECISION": "fp16"})
    resolved = config.resolve(file_layer, env_layer, config.from_kwargs({"strategy": "ddp"}))
    cfg = resolved.config
    assert (cfg.strategy, cfg.mixed_precision, cfg.grad_accum_steps, cfg.seed) == ("ddp", "fp16", 2, None)
    assert resolved.origin == {
        "strategy": "Phalanx()",
        "mixed_precision": "PHALANX_MIXED_PRECISION",
        "grad_accum_steps": "f.yaml",
    }
    assert config.worker_env(resolved) == {
        "PHALANX_STRATEGY": "ddp",
        "PHALANX_MIXED_PRECISION": "fp16",
        "PHALANX_GRAD_ACCUM_STEPS": "2",
    }


def test_every_setting_two_sources_give_differently_is_said_with_the_fix():
    """Issue 54 item 2: the winner, every loser, and how to change it (the words said at start)."""
    file_layer = config.from_mapping({"strategy": "dp", "seed": 3, "grad_accum_steps": 2}, "f.yaml")
    env_layer = config.from_env({"PHALANX_STRATEGY": "zero1", "PHALANX_SEED": "3"})
    resolved = config.resolve(file_layer, env_layer, config.from_kwargs({"strategy": "ddp"}))
    precedence = (
        "(a Phalanx() keyword beats phalanx run's flags and PHALANX_* variables, a flag beats a variable, "
        "both beat a config file)"
    )
    assert config.override_lines(resolved) == [  # seed: the same value twice is no conflict
        f"Phalanx(strategy='ddp') overrides strategy: dp in f.yaml and PHALANX_STRATEGY=zero1 {precedence}. "
        "HINT: drop strategy= from Phalanx(...) to take PHALANX_STRATEGY=zero1, or stop giving it there"
    ]


# ---- phalanx config (the template) ------------------------------------------------------------
def test_template_lists_every_setting_and_every_line_uncommented_is_accepted(tmp_path, script):
    path = tmp_path / "phalanx.yaml"
    assert cli.main(["config", str(path)]) == 0
    text = path.read_text()
    assert yaml.safe_load(text) is None  # everything commented out: a no-op file
    uncommented = "\n".join(
        line[2:] for line in text.splitlines() if line.startswith("# ") and line[2:].split(":")[0] in config.BY_NAME
    )
    full = write(tmp_path, uncommented, "all.yaml")
    assert set(values(config.from_yaml(full))) == {s.name for s in config.SETTINGS if s.default is not None}
    spec = launch_spec(["--config", full, script])  # `phalanx run --config` accepts all of it
    assert spec.worker_env == {
        config.BY_NAME[n].env: config.to_env_value(config.BY_NAME[n].default)
        for n, _ in config.from_yaml(full).items()
        if config.BY_NAME[n].env
    }
    assert cli.main(["config", str(path)]) == 2  # refuses to overwrite without --force
    assert cli.main(["config", str(path), "--force"]) == 0


# ---- phalanx run --config (no processes: the parsed spec) -------------------------------------
def test_run_flags_default_without_a_config(script):
    spec = launch_spec([script])
    assert (spec.nproc_per_node, spec.nnodes, spec.max_restarts, spec.start_method) == (None, 1, 0, "auto")
    assert spec.worker_env == {}


def test_run_config_fills_launcher_and_runtime_settings(tmp_path, script):
    path = write(
        tmp_path,
        "nproc_per_node: 3\nmax_restarts: 2\nstrategy: dp\nwatchdog_timeout: 60\n"
        "grad_accum_steps: 4\ncheckpoint_dir: ckpt\nnnodes: 1:2\nrdzv_backend: c10d\n"
        "rdzv_endpoint: 127.0.0.1:29400\nrdzv_timeout: 15\n",
    )
    spec = launch_spec(["--config", path, script])
    assert (spec.nproc_per_node, spec.max_restarts) == (3, 2)
    assert (spec.min_nnodes, spec.nnodes, spec.rdzv_backend, spec.rdzv_endpoint, spec.rdzv_timeout) == (
        1,
        2,
        "c10d",
        "127.0.0.1:29400",
        15.0,
    )
    assert spec.worker_env == {
        "PHALANX_STRATEGY": "dp",
        "PHALANX_WATCHDOG_TIMEOUT": "60",
        "PHALANX_GRAD_ACCUM_STEPS": "4",
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }


def test_run_precedence_file_lt_env_lt_flag(tmp_path, script, monkeypatch):
    path = write(tmp_path, "nproc_per_node: 3\nstrategy: dp\nmixed_precision: bf16\ngrad_accum_steps: 4\n")
    monkeypatch.setenv("PHALANX_STRATEGY", "zero1")
    monkeypatch.setenv("PHALANX_GRAD_ACCUM_STEPS", "8")
    spec = launch_spec(["--config", path, "--nproc-per-node", "2", "--mixed-precision", "fp16", script])
    assert spec.nproc_per_node == 2  # flag over file
    assert spec.worker_env == {
        "PHALANX_STRATEGY": "zero1",
        "PHALANX_GRAD_ACCUM_STEPS": "8",  # env over file
        "PHALANX_MIXED_PRECISION": "fp16",
    }  # flag over file
    spec = launch_spec(["--config", path, "--strategy", "ddp", script])
    assert spec.worker_env["PHALANX_STRATEGY"] == "ddp"  # flag over env


def test_run_config_errors_are_launch_errors(tmp_path, script):
    with pytest.raises(LaunchError, match="unknown key.*'procs'.*Valid keys: nproc_per_node"):
        launch_spec(["--config", write(tmp_path, "procs: 2\n"), script])
    with pytest.raises(LaunchError, match="deepspeed: missing.json: file not found"):
        launch_spec(["--config", write(tmp_path, "deepspeed: missing.json\n"), script])


# ---- Phalanx() and Phalanx.from_config (world of one) -----------------------------------------
def test_from_config_precedence(tmp_path, monkeypatch):
    import logging

    path = write(
        tmp_path,
        "nproc_per_node: 4\nstrategy: ddp\nseed: 7\ncollective_timeout: 30\n"
        "grad_accum_steps: 3\nlog_level: DEBUG\nlog_sinks: [jsonl]\n",
    )
    monkeypatch.setenv("PHALANX_SEED", "11")
    monkeypatch.setenv("PHALANX_LOG_LEVEL", "WARNING")
    px = Phalanx.from_config(path)
    assert px.strategy_name == "single"  # ddp in a world of one
    assert px.seed == 11  # env over file
    assert logging.getLogger("phalanx").level == logging.WARNING  # env over file
    assert (px.settings.grad_accum_steps, px.config.log_sinks, px.config.collective_timeout) == (3, ["jsonl"], 30.0)
    px = Phalanx.from_config(path, seed=5, grad_accum_steps=6, log_level="INFO")
    assert (px.seed, px.settings.grad_accum_steps) == (5, 6)  # keywords over env and file
    assert logging.getLogger("phalanx").level == logging.INFO
    with pytest.raises(config.ConfigError, match="unknown key"):
        Phalanx.from_config(write(tmp_path, "stratgy: ddp\n", "typo.yaml"))


def test_phalanx_refuses_bad_env_and_arguments_before_joining_a_group(monkeypatch):
    monkeypatch.setenv("PHALANX_STRATEGY", "zero4")
    with pytest.raises(config.ConfigError, match="PHALANX_STRATEGY=zero4: choose one of dp, ddp, zero1"):
        Phalanx()
    monkeypatch.delenv("PHALANX_STRATEGY")
    with pytest.raises(config.ConfigError, match=r"Phalanx\(mixed_precision='fp8'\): choose one of no, bf16, fp16"):
        Phalanx(mixed_precision="fp8")


def test_yaml_words_no_and_off_are_not_booleans_here(tmp_path):
    layer = config.from_yaml(write(tmp_path, "mixed_precision: no\nprogress: off\nlog_all_ranks: yes\n"))
    assert values(layer) == {"mixed_precision": "no", "progress": "off", "log_all_ranks": True}


def test_yaml_base_60_integers_are_not_read(tmp_path):
    layer = config.from_yaml(write(tmp_path, "nnodes: 1:2\nnproc_per_node: 4\nmaster_port: 0x7530\n"))
    assert values(layer) == {"nnodes": "1:2", "nproc_per_node": 4, "master_port": 30000}


def test_environment_is_read_only_where_it_is_the_module_s_job():
    """Settings are resolved once and handed down: no module reads PHALANX_* variables itself."""
    root = os.path.join(os.path.dirname(config.__file__), os.pardir)
    readers = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fp:
                    if "os.environ" in fp.read():
                        readers.add(os.path.relpath(path, root).replace(os.sep, "/"))
    allowed_folders = ("launch/", "cluster/")  # the launcher and cluster detection
    allowed = {
        "runtime/context.py",  # the process context: what the launcher and the agent told this worker
        "doctor/command.py",
        "plan/command.py",  # commands that report on this machine
        "parity/command.py",  # launches `phalanx run` twice, telling its workers what to record
        "model/compile.py",
    }  # finds the C++ compiler inductor would use ($CXX), as inductor does
    assert {r for r in readers if not r.startswith(allowed_folders)} <= allowed
