"""Every flag of `torchrun --help` (torch 2.13), accepted by `phalanx run` with torchrun's meaning.

Why a table: torchrun users bring their command lines and their PET_* variables (Kubeflow's
PyTorchJob sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, PET_MASTER_PORT).
Each row names a flag's option strings and torch's `dest` (which fixes its PET_<DEST> name), how a
value is checked, and whether run_command defines the flag itself (the flags phalanx had before).
tests/launcher/test_torchrun_parity.py compares this table with torch's own parser, so a flag a new
torch adds fails a test instead of surprising a user.

Precedence, as torchrun's: a flag on the command line, else PET_<DEST> from the environment, else
phalanx's config file (for settings it has), else the default. A PET_* value torchrun would reject
is a `LaunchError` naming the variable, before any worker starts. Pure: no torch import.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import signal
from typing import Any, Callable, Mapping

from phalanx.launch.launch_error import LaunchError

PET_PREFIX = "PET_"
_STD_VALUE = re.compile(r"^[0123]$")  # torch's elastic Std: 0 none, 1 stdout, 2 stderr, 3 both
_STD_MAPPING = re.compile(r"^(\d:[0123],)*(\d:[0123])$")  # per local rank, e.g. 0:3,1:0
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def std_spec(text: str) -> str:
    """--redirects / --tee: 0-3, or LOCAL_RANK:0-3 pairs; checked here, turned into torch's Std at launch."""
    if not (_STD_VALUE.match(text) or _STD_MAPPING.match(text)):
        raise argparse.ArgumentTypeError(
            f"must be 0 (none), 1 (stdout), 2 (stderr), 3 (both) or per local rank such as 0:3,1:0, got {text!r}"
        )
    return text


def ranks_list(text: str) -> tuple[int, ...]:
    """--local-ranks-filter: '0,2' -> (0, 2)."""
    try:
        ranks = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of local ranks such as 0,1, got {text!r}"
        ) from None
    if any(rank < 0 for rank in ranks):
        raise argparse.ArgumentTypeError(f"local ranks must be >= 0, got {text!r}")
    return ranks


def rdzv_conf(text: str) -> dict[str, str]:
    """--rdzv-conf: 'key=value,key2=value2' -> dict, refusing what torch's rendezvous would refuse."""
    config: dict[str, str] = {}
    for item in (part for part in text.strip().split(",") if text.strip()):
        key, sep, value = item.partition("=")
        if not key.strip() or not sep or not value.strip():
            raise argparse.ArgumentTypeError(f"must be KEY=VALUE[,KEY=VALUE...], got {text!r} (bad item {item!r})")
        config[key.strip()] = value.strip()
    return config


def comma_list(text: str) -> tuple[str, ...]:
    """--duplicate-stdout-filters / --duplicate-stderr-filters: 'a,b' -> ('a', 'b')."""
    return tuple(item for item in text.split(",") if item)


def signal_names(text: str) -> str:
    """--signals-to-handle: names of signals this platform knows."""
    unknown = [
        name.strip() for name in text.split(",") if not isinstance(getattr(signal, name.strip(), None), signal.Signals)
    ]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown signal(s) {', '.join(map(repr, unknown))} in {text!r}; e.g. {DEFAULT_SIGNALS}"
        )
    return text


def numa_binding(text: str) -> str:
    if text not in NUMA_BINDINGS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(NUMA_BINDINGS)}, got {text!r}")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _schema(dest: str) -> Callable[[str], Any]:
    """The parser of a flag the settings schema owns: its row's kind, errors as argparse's."""
    from phalanx import config

    kind = config.BY_NAME[dest].kind

    def parse(text: str) -> str:
        try:
            kind.from_text(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text  # as if given on the command line: the settings layer reads it like a flag

    parse.__name__ = kind.name
    return parse


for _function, _name in (
    (std_spec, "0-3 or RANK:0-3,..."),
    (ranks_list, "local ranks"),
    (rdzv_conf, "KEY=VALUE,..."),
    (signal_names, "signal names"),
    (numa_binding, "numa binding"),
    (_int, "int"),
    (_float, "number"),
    (_positive_float, "seconds"),
):
    _function.__name__ = _name  # argparse names the type in "invalid <name> value" messages


@dataclasses.dataclass(frozen=True)
class TorchrunFlag:
    """One torchrun flag: its spellings, torch's dest (PET_<DEST>), how a value is checked."""

    dest: str
    options: tuple[str, ...]
    parse: Callable[[str], Any] | None = None
    """Checks/converts a value from the command line or PET_*; None for switches (no value)."""
    default: Any = None
    help: str = ""
    pet: bool = True
    """torchrun reads PET_<DEST> for it (its `env`/`check_env` actions; not --logs-specs, --numa-binding)."""
    defined_by_run_command: bool = False
    """The flag predates this table: run_command.configure adds it; only PET_* handling is here."""

    @property
    def switch(self) -> bool:
        return self.parse is None

    @property
    def pet_name(self) -> str:
        return PET_PREFIX + self.dest.upper()


def _both(name: str) -> tuple[str, ...]:
    """'--log-dir' -> ('--log-dir', '--log_dir'): torchrun accepts both spellings."""
    underscored = name.replace("-", "_").replace("__", "--", 1)
    return (name, underscored) if underscored != name else (name,)


def _ours(dest: str, option: str) -> TorchrunFlag:
    """A torchrun flag that is a setting of phalanx's schema: the row parses and checks it."""
    return TorchrunFlag(dest, _both(option), _schema(dest), defined_by_run_command=True)


FLAGS: tuple[TorchrunFlag, ...] = (
    # torchrun flags that are schema settings: run_command defines them from their rows, and the
    # rows' kinds check their PET_* values; only torch's dest (the PET_<DEST> name) is recorded here
    _ours("nnodes", "--nnodes"),
    _ours("nproc_per_node", "--nproc-per-node"),
    _ours("rdzv_backend", "--rdzv-backend"),
    _ours("rdzv_endpoint", "--rdzv-endpoint"),
    _ours("rdzv_id", "--rdzv-id"),
    _ours("max_restarts", "--max-restarts"),
    _ours("start_method", "--start-method"),
    _ours("node_rank", "--node-rank"),
    _ours("master_addr", "--master-addr"),
    _ours("master_port", "--master-port"),
    TorchrunFlag("module", ("-m", "--module"), None, defined_by_run_command=True),
    # the rest of torchrun's flags, added by `configure` below
    TorchrunFlag(
        "rdzv_conf",
        _both("--rdzv-conf"),
        rdzv_conf,
        {},
        "extra rendezvous settings KEY=VALUE,... (e.g. join_timeout=60), as torchrun",
    ),
    TorchrunFlag(
        "standalone",
        ("--standalone",),
        None,
        False,
        "single node with a rendezvous on a free loopback port (phalanx's default on one node anyway)",
    ),
    TorchrunFlag(
        "monitor_interval",
        _both("--monitor-interval"),
        _positive_float,
        0.1,
        "seconds between the agent's checks of the workers' state",
    ),
    TorchrunFlag(
        "event_log_handler", _both("--event-log-handler"), str, "null", "torch elastic event log handler name"
    ),
    TorchrunFlag(
        "role", ("--role",), str, "default", "user-defined role of the workers (shown in torch's log prefixes)"
    ),
    TorchrunFlag(
        "no_python",
        _both("--no-python"),
        None,
        False,
        "run SCRIPT as an executable, not with python (no -m; spawned, never forked)",
    ),
    TorchrunFlag(
        "run_path",
        _both("--run-path"),
        None,
        False,
        "run SCRIPT inside the worker with runpy.run_path (phalanx's fork start does this already)",
    ),
    TorchrunFlag(
        "log_dir",
        _both("--log-dir"),
        str,
        None,
        "directory for the workers' stdout/stderr files (with --redirects/--tee), as torchrun lays them out",
    ),
    TorchrunFlag(
        "redirects",
        ("-r", "--redirects"),
        std_spec,
        "0",
        "send workers' streams to files under --log-dir: 0 none, 1 stdout, 2 stderr, 3 both, or RANK:N,...",
    ),
    TorchrunFlag(
        "tee",
        ("-t", "--tee"),
        std_spec,
        "0",
        "like --redirects, and also print the streams with a [role RANK]: prefix per line",
    ),
    TorchrunFlag(
        "local_ranks_filter",
        _both("--local-ranks-filter"),
        ranks_list,
        None,
        "print only these local ranks' output, e.g. 0 (the others' go to --log-dir files or nowhere)",
    ),
    TorchrunFlag(
        "duplicate_stdout_filters",
        _both("--duplicate-stdout-filters"),
        comma_list,
        (),
        "also copy stdout lines containing any of these strings to filtered_stdout.log",
    ),
    TorchrunFlag(
        "duplicate_stderr_filters",
        _both("--duplicate-stderr-filters"),
        comma_list,
        (),
        "also copy stderr lines containing any of these strings to filtered_stderr.log",
    ),
    TorchrunFlag(
        "local_addr",
        _both("--local-addr"),
        str,
        None,
        "this node's address as the other nodes reach it (default: worked out from the route to the master)",
    ),
    TorchrunFlag(
        "logs_specs",
        _both("--logs-specs"),
        str,
        None,
        "name of a torchrun.logs_specs entry point class replacing torch's DefaultLogsSpecs",
        pet=False,
    ),
    TorchrunFlag(
        "numa_binding",
        _both("--numa-binding"),
        numa_binding,
        None,
        f"bind each worker to its GPU's NUMA resources: {', '.join(NUMA_BINDINGS)}",
        pet=False,
    ),
    TorchrunFlag(
        "signals_to_handle",
        _both("--signals-to-handle"),
        signal_names,
        DEFAULT_SIGNALS,
        "signals the agent forwards to the workers before stopping",
    ),
    TorchrunFlag(
        "shutdown_timeout",
        _both("--shutdown-timeout"),
        _int,
        None,
        "seconds between SIGTERM and SIGKILL when the workers are stopped",
    ),
    TorchrunFlag(
        "virtual_local_rank",
        _both("--virtual-local-rank"),
        None,
        False,
        "every worker sees LOCAL_RANK=0 and only its own GPU (CUDA_VISIBLE_DEVICES)",
    ),
)
BY_DEST: dict[str, TorchrunFlag] = {flag.dest: flag for flag in FLAGS}
REFUSED: dict[str, str] = {}
"""torchrun dests phalanx refuses, with the reason (none today: every flag has torchrun's meaning)."""


def configure(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the torchrun flags run_command does not define to `group` (a parser or one of its argument
    groups); "not given" is left unset (SUPPRESS)."""
    for flag in FLAGS:
        if flag.defined_by_run_command:
            continue
        if flag.switch:
            group.add_argument(
                *flag.options, dest=flag.dest, action="store_true", default=argparse.SUPPRESS, help=flag.help
            )
        else:
            group.add_argument(
                *flag.options,
                dest=flag.dest,
                type=flag.parse,
                default=argparse.SUPPRESS,
                help=f"{flag.help} (default {flag.default})" if flag.default not in (None, (), {}) else flag.help,
            )


def _from_pet(flag: TorchrunFlag, text: str) -> Any:
    option = next(option for option in flag.options if option.startswith("--"))
    hint = f"HINT: fix or unset {flag.pet_name} (torchrun reads it as {option})."
    if flag.switch:
        try:
            return bool(int(text))
        except ValueError:
            raise LaunchError(f"{flag.pet_name}={text!r} is not valid for {option}: must be 0 or 1. {hint}") from None
    try:
        return flag.parse(text) if flag.parse else text
    except (argparse.ArgumentTypeError, ValueError) as error:
        raise LaunchError(f"{flag.pet_name}={text!r} is not valid for {option}: {error}. {hint}") from None


def apply_pet_env(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Fill the torchrun flags not given on the command line from PET_<DEST>, then with defaults.

    Flags run_command defines (the schema's launcher settings) are None when not given; only PET_*
    fills them here, and the config file and schema defaults come after. Values are checked like the flag's; a bad one raises LaunchError naming the variable.
    """
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        given = (
            hasattr(args, flag.dest)
            and value is not None
            and not (flag.switch and flag.defined_by_run_command and not value)
        )
        if given:
            continue
        text = env.get(flag.pet_name) if flag.pet else None
        if text is not None and text != "":
            setattr(args, flag.dest, _from_pet(flag, text))
        elif not flag.defined_by_run_command:
            setattr(args, flag.dest, flag.default)


@dataclasses.dataclass(frozen=True)
class AgentOptions:
    """torchrun's settings for torch's elastic agent that phalanx passes through unchanged."""

    rdzv_conf: dict[str, str] = dataclasses.field(default_factory=dict)
    monitor_interval: float = 0.1
    event_log_handler: str = "null"
    role: str = "default"
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: tuple[int, ...] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    local_addr: str | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    signals_to_handle: str = DEFAULT_SIGNALS
    shutdown_timeout: int | None = None
    virtual_local_rank: bool = False
    no_python: bool = False
    run_path: bool = False


def agent_options(args: argparse.Namespace) -> AgentOptions:
    """The AgentOptions of parsed (and PET-filled) arguments."""
    names = [field.name for field in dataclasses.fields(AgentOptions)]
    return AgentOptions(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def check_agent_options(options: AgentOptions, *, is_module: bool, nproc_per_node: int | None, target: str) -> None:
    """Contradictions torchrun would refuse too, reported before anything starts."""
    if options.no_python and is_module:
        raise LaunchError(
            "--no-python and -m/--module cannot be combined: -m runs a Python module. HINT: drop one of them."
        )
    if options.no_python and options.run_path:
        raise LaunchError(
            "--no-python and --run-path cannot be combined: --run-path runs a Python file in the worker. "
            "HINT: drop one of them."
        )
    if options.log_dir is not None and not options.log_dir:
        raise LaunchError("--log-dir is empty. HINT: name a directory, e.g. --log-dir logs")
    if nproc_per_node is not None and options.local_ranks_filter:
        outside = [rank for rank in options.local_ranks_filter if rank >= nproc_per_node]
        if outside:
            raise LaunchError(
                f"--local-ranks-filter names local rank(s) {','.join(map(str, outside))}, but this node "
                f"runs {nproc_per_node} worker(s) (local ranks 0..{nproc_per_node - 1})."
            )
    if options.no_python and not is_module and shutil.which(target) is None:
        raise LaunchError(
            f"--no-python runs {target!r} as a program, but it is not an executable file or a command on "
            "PATH. HINT: check the name and its execute permission, or drop --no-python for a Python script."
        )


def _std(text: str) -> Any:
    from torch.distributed.elastic.multiprocessing import Std

    return Std.from_str(text)


def launch_config_kwargs(options: AgentOptions) -> dict[str, Any]:
    """LaunchConfig fields for these options (imports torch: call once the launch is decided)."""
    import os

    if options.logs_specs:
        from torch.distributed.run import _get_logs_specs_class  # the entry-point lookup torchrun itself uses

        specs_class = _get_logs_specs_class(options.logs_specs)
    else:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs as specs_class
    logs_specs = specs_class(
        log_dir=options.log_dir,
        redirects=_std(options.redirects),
        tee=_std(options.tee),
        local_ranks_filter=set(options.local_ranks_filter) if options.local_ranks_filter else None,
    )
    kwargs: dict[str, Any] = {
        "logs_specs": logs_specs,
        "role": options.role,
        "monitor_interval": options.monitor_interval,
        "event_log_handler": options.event_log_handler,
        "signals_to_handle": options.signals_to_handle,
        "duplicate_stdout_filters": list(options.duplicate_stdout_filters) or None,
        "duplicate_stderr_filters": list(options.duplicate_stderr_filters) or None,
        "virtual_local_rank": options.virtual_local_rank,
        "shutdown_timeout": options.shutdown_timeout,
        "log_line_prefix_template": os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
    }
    if options.numa_binding is not None:
        from torch.numa.binding import AffinityMode, NumaOptions

        kwargs["numa_options"] = NumaOptions(affinity_mode=AffinityMode(options.numa_binding))
    return _supported_by_this_torch(kwargs, options)


def _supported_by_this_torch(kwargs: dict[str, Any], options: AgentOptions) -> dict[str, Any]:
    """Drop LaunchConfig fields an older torch does not have while they hold torchrun's default;
    a value the user asked for that this torch cannot honour is an error, never silently dropped."""
    import dataclasses as dc

    import torch
    from torch.distributed.launcher.api import LaunchConfig

    known = {field.name for field in dc.fields(LaunchConfig)}
    defaults = AgentOptions()
    unsupported = {
        "duplicate_stdout_filters": options.duplicate_stdout_filters != defaults.duplicate_stdout_filters,
        "duplicate_stderr_filters": options.duplicate_stderr_filters != defaults.duplicate_stderr_filters,
        "virtual_local_rank": options.virtual_local_rank != defaults.virtual_local_rank,
        "shutdown_timeout": options.shutdown_timeout != defaults.shutdown_timeout,
        "signals_to_handle": options.signals_to_handle != defaults.signals_to_handle,
        "numa_options": options.numa_binding is not None,
        "event_log_handler": options.event_log_handler != defaults.event_log_handler,
    }
    asked = [name for name in kwargs if name not in known and unsupported.get(name, True)]
    if asked:
        raise LaunchError(
            f"torch {torch.__version__}'s elastic agent has no {', '.join(asked)}; "
            "HINT: drop the flag, or use the torch phalanx pins for tests (2.13)"
        )
    return {name: value for name, value in kwargs.items() if name in known}
