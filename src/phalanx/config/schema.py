"""The one description of every phalanx setting. Each row gives its name (the `Phalanx()` keyword
argument and the YAML key), its kind, default and help; the flag (`--name`, also `--name_with_underscores`)
and the environment variable (`PHALANX_NAME`) follow from the name. `phalanx run`'s flags, the
variables exported to workers, `Phalanx()`'s arguments, config files and the `phalanx config`
template are all derived from these rows: a new setting is one row here.

Launcher rows are read by `phalanx run` only (flags and config files); runtime rows reach each
worker's `Phalanx()`. Pure Python, no torch: the launcher checks everything before a worker starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phalanx.config import kinds, names, profile_steps
from phalanx.config.kinds import Kind
from phalanx.config.names import Needs


class Scope:
    LAUNCHER = "launcher"
    RUNTIME = "runtime"


@dataclass(frozen=True)
class Group:
    """A section of `phalanx run --help` and of the settings reference (docs/settings.md).

    In SETTINGS a group stands before its rows: each row belongs to the group above it, so a new
    row put next to related rows lands in their group."""

    name: str
    description: str


LAUNCH = Group("launch", "how many processes, where")
LAYOUT = Group("layout and strategy", "how the model is split over the ranks")
LOOP = Group("training loop", "precision, accumulation, seeds, timeouts")
CHECKPOINTS = Group("checkpoints", "where, how many, how")
LOGGING = Group("logging", "messages, metrics, trackers, profiling")
TORCHRUN = Group(
    "torchrun compatibility",
    "torchrun's agent flags, also read from PET_<NAME> variables as torchrun "
    "does, and torch.distributed.launch's --local-rank",
)
# In reading order; TORCHRUN holds torchrun's own flags (launch/torchrun_flags.py), no schema row.
GROUPS: tuple[Group, ...] = (LAUNCH, LAYOUT, LOOP, CHECKPOINTS, LOGGING, TORCHRUN)


@dataclass(frozen=True)
class Setting:
    """One row of the schema."""

    name: str
    kind: Kind
    default: Any
    help: str
    scope: str = Scope.RUNTIME
    env_name: str | None = None  # only where a public name predates the PHALANX_<NAME> rule
    bool_flag: bool = False  # `--name` / `--no-name` instead of `--name VALUE`
    value_name: str | None = None  # how --help shows the value (default: the name's last word)
    needs: Needs = Needs.ALWAYS  # what the parallel layout must have for this setting to do anything
    group: Group | None = None  # set by `grouped` from the group marker above the row

    @property
    def env(self) -> str | None:
        """The PHALANX_* variable of a runtime setting (launcher settings: only where the row names one)."""
        if self.scope != Scope.RUNTIME:
            return self.env_name  # a launcher setting with a variable of its own (PHALANX_DASHBOARD)
        return self.env_name or f"PHALANX_{self.name.upper()}"

    @property
    def metavar(self) -> str:
        return self.value_name or self.name.split("_")[-1].upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """Both spellings, as torchrun accepts them."""
        underscored = "--" + self.name
        return (self.flag,) if underscored == self.flag else (self.flag, underscored)


def _sink_names() -> tuple[str, ...]:
    return ("auto", *names.METRICS_DESTINATIONS)


def _tracker_names() -> tuple[str, ...]:
    return names.METRICS_DESTINATIONS


def _step_range(text: str) -> str:
    return profile_steps.parse(text).text


def _strategy(text: str) -> str:
    """`FSDP ` -> zero3: aliases are resolved here, once; an unknown name stays for the choice to refuse."""
    key = names.canonical_strategy(text)
    return key if key in names.STRATEGIES else text.strip().lower()


def _deepspeed_text(text: str) -> str:
    return kinds.PATH.from_text(text)


def _dashboard_address(text: str) -> str:
    """`8080` or `HOST:8080` -> `HOST:PORT` (host 127.0.0.1 when not given)."""
    host, _, port = text.strip().rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected [HOST:]PORT with a port in 1..65535, e.g. 8080 or 0.0.0.0:8080, got {text!r}")
    return f"{host.strip('[]') or '127.0.0.1'}:{int(port)}"


def grouped(*items: Group | Setting) -> tuple[Setting, ...]:
    """The rows, each given the group written above it."""
    rows, current = [], None
    for item in items:
        if isinstance(item, Group):
            current = item
        elif current is None:
            raise ValueError(f"setting {item.name!r} comes before any group: put a Group above it")
        else:
            rows.append(dataclasses.replace(item, group=current))
    return tuple(rows)


L = Scope.LAUNCHER

SETTINGS: tuple[Setting, ...] = grouped(
    LAUNCH,
    Setting(
        "nproc_per_node",
        kinds.COUNT_OR_AUTO,
        "auto",
        "workers per node: a number; auto (one per visible GPU, else 2 on CPU); gpu (one per visible GPU); "
        "cpu (one per core)",
        L,
        value_name="N|auto|gpu|cpu",
    ),
    Setting(
        "allow_oversubscribe",
        kinds.BOOL,
        False,
        "start more workers than this node can run (beyond 8 a core, or its pids cgroup / ulimit -u "
        "at about 20 threads a worker), which is refused otherwise",
        L,
        bool_flag=True,
    ),
    Setting(
        "nnodes",
        kinds.NNODES,
        "1",
        "number of nodes, or MIN:MAX for an elastic range (c10d)",
        L,
        value_name="N|MIN:MAX",
    ),
    Setting("node_rank", kinds.integer(0), 0, "rank of this node (static rendezvous)", L),
    Setting("master_addr", kinds.TEXT, None, "address of node 0 (default 127.0.0.1 on one node)", L),
    Setting(
        "master_port", kinds.integer(1, 65535), None, "port of node 0's store (default on one node: a free port)", L
    ),
    Setting("rdzv_backend", kinds.TEXT, "static", "rendezvous backend: static, c10d, etcd...", L),
    Setting("rdzv_endpoint", kinds.TEXT, "", "rendezvous endpoint HOST:PORT", L),
    Setting("rdzv_id", kinds.TEXT, "", "job id shared by all nodes", L),
    Setting(
        "rdzv_timeout",
        kinds.seconds(False),
        600.0,
        "seconds for all nodes to meet before failing with a report of what is missing; with etcd, also "
        "how long etcd may stop answering mid-job before the workers stop with a checkpoint",
        L,
    ),
    Setting("max_restarts", kinds.integer(0), 0, "restarts of the worker group after a failure", L),
    Setting(
        "start_method",
        kinds.choice(("auto", "fork", "spawn", "forkserver")),
        "auto",
        "fork: workers inherit the launcher's torch import (fast); spawn, forkserver: fresh interpreters like "
        "torchrun; auto: fork unless GPUs are in use",
        L,
    ),
    Setting(
        "gpus", kinds.TEXT, None, "GPU indices to use, e.g. 0,1; sets CUDA_VISIBLE_DEVICES and the process count", L
    ),
    LAYOUT,
    Setting(
        "strategy",
        kinds.choice(names.STRATEGIES, _strategy),
        "auto",
        "dp, ddp, zero1, zero2, zero3 (= fsdp), hsdp, single (one device, the model as written: what a world of "
        "one runs) or auto: ddp if the model fits the memory budget, else zero3; each a preset of the parallel "
        "plan (data-parallel replicate x shard degrees, sharding stage)",
    ),
    Setting(
        "tp",
        kinds.integer(1),
        1,
        "tensor-parallel degree: ranks that split each layer of the model (keep it within one node); the "
        "data-parallel dims get the processes / tp",
    ),
    Setting(
        "tp_plan",
        kinds.pattern_map(
            names.TP_STYLES, names.TP_STYLE_ALIASES, "a mapping of module name patterns to tensor-parallel styles"
        ),
        None,
        "how tensor parallel splits this model: {module name pattern: colwise | rowwise | ...}, e.g. "
        '{"layers.*.attn.q": "colwise"} (default: the model\'s own transformers plan); used when tp > 1',
        value_name="PLAN",
        needs=Needs.TENSOR_PARALLEL,
    ),
    Setting(
        "sequence_parallel",
        kinds.BOOL,
        False,
        "tensor parallel: also split norms and dropout along the sequence between the split layers",
        bool_flag=True,
        needs=Needs.TENSOR_PARALLEL,
    ),
    Setting(
        "pp",
        kinds.integer(1),
        1,
        "pipeline-parallel degree: stages the model's blocks are cut into, one pipeline rank each (stages "
        "furthest apart in the mesh: across nodes); the data-parallel dims get the processes / (tp x pp)",
    ),
    Setting(
        "cp",
        kinds.integer(1),
        1,
        "context-parallel degree: ranks that split each row's sequence (long sequences; attention across the "
        "cut by Ulysses or an all-gather of keys and values, any mask); they read the same rows, and the "
        "data-parallel dims get the processes / (tp x pp x cp)",
    ),
    Setting(
        "ep",
        kinds.integer(1),
        1,
        "expert-parallel degree: ranks that split each mixture-of-experts layer's experts (the model's "
        "base_model_ep_plan), each token sent to its experts' rank and back by all-to-all; taken from the "
        "data-parallel x cp ranks (it must divide them and the model's number of experts), whose non-expert "
        "parameters stay data parallel (ddp, zero2, zero3)",
    ),
    Setting(
        "pp_schedule",
        kinds.choice(names.PP_SCHEDULES, names.canonical_pp_schedule),
        "1F1B",
        "pipeline schedule, torch's names in any case: 1F1B, GPipe (one stage per rank); Interleaved1F1B, "
        "LoopedBFS, InterleavedZeroBubble (2 stages per rank, looped); ZBVZeroBubble, DualPipeV (2 per rank, "
        "in a V)",
        value_name="SCHEDULE",
        needs=Needs.PIPELINE,
    ),
    Setting(
        "pp_microbatches",
        kinds.integer(1),
        None,
        "microbatches a pipeline step cuts each rank's batch into (default 2 x pp): at least pp, dividing the batch",
        value_name="N",
        needs=Needs.PIPELINE,
    ),
    Setting(
        "pp_split",
        kinds.names_list(),
        None,
        "module names to cut pipeline stages before, pp - 1 of them, e.g. layers.4 (default: even by "
        "parameter count over the model's largest ModuleList/Sequential)",
        value_name="NAMES",
        needs=Needs.PIPELINE,
    ),
    Setting(
        "host_mmap_threshold",
        kinds.size_or_auto(32 * 2**20, "glibc's largest mmap threshold is 32MiB"),
        "auto",
        "CPU runs on glibc: host allocations this large or larger are mapped on their own and returned to the "
        "system when freed (mallopt M_MMAP_THRESHOLD, for the rest of the process once set), so zero2/zero3's "
        "freed gathered blocks do not stay resident; the price: every such tensor made again, activations "
        "included, is fresh pages faulted in and zeroed (1MiB cost ddp about 17% of its CPU speed; zero3 ran at "
        "0.80-0.87x ddp's speed with it, 0.85-0.86x without). auto: 1MiB where parameters are sharded (zero2, "
        "zero3, hsdp), glibc's default for every other layout; 0: glibc's default; at most 32MiB",
        value_name="SIZE",
    ),
    Setting(
        "memory_budget",
        kinds.BYTES,
        None,
        "per-device memory budget strategy auto compares the model with, e.g. 8GB "
        "(default: 60% of the GPU, or of RAM shared by the local ranks)",
        needs=Needs.AUTO,
    ),
    Setting(
        "deepspeed",
        kinds.python(_deepspeed_text, "path of a DeepSpeed JSON config (or a dict)"),
        None,
        "path of a DeepSpeed JSON config, mapped onto these settings",
        env_name="PHALANX_DEEPSPEED_CONFIG",
    ),
    Setting(
        "activation_checkpointing",
        kinds.BOOL_OR_NAMES,
        False,
        "recompute activations in backward: true (each sharding unit), false, or module class names "
        "(Phalanx(): also classes or a predicate)",
    ),
    Setting(
        "compile",
        kinds.BOOL_OR_OPTIONS,
        False,
        "torch.compile each sharding unit (regional compilation; Phalanx(): also a dict of torch.compile options)",
        bool_flag=True,
    ),
    Setting(
        "embedding_exchange",
        kinds.choice(("auto", "params")),
        "auto",
        "zero2/zero3 embedding tables: auto (each rank keeps its rows; a forward exchanges the looked-up rows "
        "or the table, whichever is smaller) or params (gathered whole like any parameter)",
        needs=Needs.ROW_SHARDED_EMBEDDINGS,
    ),
    Setting(
        "zero1_gather",
        kinds.choice(names.ZERO1_GATHER_MODES),
        "bucketed",
        "zero1: how updated chunks reach every rank: bucketed (transient buffers of 1/16 of the parameters' bytes, "
        "within 1-64 MiB, nothing kept between steps) or persistent (one all-gather of the whole model into a "
        "buffer kept for good: a little faster, the parameters' bytes more per rank)",
        needs=Needs.SHARDED_OPTIMIZER,
    ),
    Setting(
        "zero1_grads",
        kinds.choice(names.ZERO1_GRADS_MODES),
        "all_reduce",
        "zero1: how gradients reach their owners: all_reduce (DDP's; every rank's .grad holds the whole "
        "gradient) or reduce_scatter (each rank receives the sums of its own rows only: with the gather, the "
        "bytes of one all-reduce; .grad is the gradient in this rank's rows only, torch's clip_grad_norm_ "
        "is routed to the owners' norms, code reading whole gradients is not; on gloo it costs more CPU than "
        "the all-reduce, and it is not yet measured on GPUs)",
        needs=Needs.SHARDED_OPTIMIZER,
    ),
    Setting(
        "sync_batchnorm",
        kinds.BOOL,
        False,
        "convert BatchNorm layers to SyncBatchNorm at prepare: statistics over every rank's samples, as one "
        "process on the global batch (gloo and NCCL)",
        bool_flag=True,
    ),
    Setting("cpu", kinds.BOOL, False, "run on the CPU (gloo) even when GPUs are visible", bool_flag=True),
    Setting(
        "device_placement",
        kinds.BOOL,
        True,
        "move each batch of a prepared loader to the rank's device",
        bool_flag=True,
    ),
    Setting(
        "split_batches",
        kinds.BOOL,
        False,
        "a prepared loader's batch_size is the global batch: each data-parallel rank gets batch_size / ranks, "
        "so a resume on another world size keeps the global batch",
        bool_flag=True,
    ),
    # DistributedDataParallel (ddp and zero1 without tensor parallel)
    Setting(
        "find_unused_parameters",
        kinds.BOOL,
        False,
        "DDP: let some parameters get no gradient in a step (slower; only for models that need it)",
        bool_flag=True,
        needs=Needs.DDP,
    ),
    Setting(
        "static_graph",
        kinds.BOOL,
        False,
        "DDP: the set of used parameters never changes between steps (lets DDP optimise)",
        bool_flag=True,
        needs=Needs.DDP,
    ),
    Setting(
        "bucket_cap_mb",
        kinds.positive_number("MB"),
        None,
        "DDP: gradient bucket size in MB (torch's default 25)",
        needs=Needs.DDP,
    ),
    Setting(
        "gradient_as_bucket_view",
        kinds.BOOL,
        True,
        "DDP: gradients are views into the communication buckets (one copy less)",
        bool_flag=True,
        needs=Needs.DDP,
    ),
    Setting(
        "comm_hook",
        kinds.choice(("none", "bf16", "fp16", "powersgd")),
        "none",
        "DDP gradient compression: none, bf16, fp16 or powersgd (torch's comm hooks)",
        needs=Needs.DDP,
    ),
    Setting(
        "powersgd_rank",
        kinds.integer(1),
        1,
        "comm_hook powersgd: rank of the low-rank gradient approximation",
        needs=Needs.DDP,
    ),
    Setting(
        "powersgd_start_iter",
        kinds.integer(1),
        1000,
        "comm_hook powersgd: plain all-reduce for this many steps first (at least 2)",
        needs=Needs.DDP,
    ),
    LOOP,
    Setting("mixed_precision", kinds.choice(names.PRECISIONS, names.canonical_precision), "no", "no, bf16 or fp16"),
    Setting("grad_accum_steps", kinds.integer(1), 1, "micro-batches per optimizer step (px.accumulate)"),
    Setting(
        "grad_accum_remainder",
        kinds.choice(("flush", "drop")),
        "flush",
        "an epoch's last, incomplete accumulation cycle: flush (step on the epoch's last batch) or drop "
        "(discard its gradients)",
    ),
    Setting(
        "average_tokens_across_ranks",
        kinds.BOOL,
        True,
        "a transformers causal LM called with labels= (and no num_items_in_batch) while training: its loss is "
        "the mean over the target tokens of every data-parallel rank, as one process's over the global batch "
        "(each such forward all-reduces the ranks' token counts and passes num_items_in_batch, as transformers' "
        "Trainer does with average_tokens_across_devices); off: each rank's mean over its own tokens, averaged",
        bool_flag=True,
    ),
    Setting(
        "seed",
        kinds.integer(),
        None,
        "seed of the data order and of Python's, NumPy's and torch's RNGs on every rank "
        "(unset: data order from seed 0, global RNGs untouched)",
    ),
    Setting(
        "worker_seeds",
        kinds.choice(("per_rank", "shared")),
        "per_rank",
        "DataLoader workers' seeds: per_rank (each rank's workers their own streams, from seed, rank and "
        "epoch) or shared (torch's seeds, the same on every rank: augmentations that must match across ranks)",
    ),
    Setting("collective_timeout", kinds.seconds(False), 300.0, "seconds a collective may wait before failing"),
    Setting(
        "watchdog_timeout",
        kinds.seconds(True),
        60.0,
        "seconds without progress on any rank before the hang is reported; 0 turns the watchdog off",
    ),
    Setting(
        "debug",
        kinds.BOOL,
        False,
        "check every phalanx collective for mismatched calls across ranks (slower)",
        bool_flag=True,
    ),
    CHECKPOINTS,
    Setting(
        "checkpoint_dir",
        kinds.LOCATION,
        None,
        "checkpoint root, a directory or an fsspec URL (s3://bucket/prefix): px.save_state()/load_state() "
        "with no path use it "
        "(with --max-restarts, runs resume by themselves)",
    ),
    Setting(
        "checkpoint_keep", kinds.integer(0), 3, "checkpoints kept under checkpoint_dir, newest first (0 keeps all)"
    ),
    Setting(
        "checkpoint_async", kinds.BOOL, False, "px.save_state() writes in the background by default", bool_flag=True
    ),
    Setting(
        "preemption_signals",
        kinds.SIGNALS,
        "SIGTERM,SIGUSR1",
        "signals that stop the job after the current step with a checkpoint of it (when checkpoint_dir is "
        "set), exit code 128 + the signal; none: signals act as they would without phalanx",
        value_name="SIGNALS",
    ),
    Setting(
        "preempt_grace",
        kinds.seconds(False),
        120.0,
        "seconds a preemption signal leaves before the job is killed: phalanx run waits that long for the "
        "checkpoint, phalanx slurm asks for --signal=USR1@<grace>, and under SLURM the checkpoint is also "
        "taken this long before the job's end time",
    ),
    Setting(
        "requeue",
        kinds.choice(("auto", "on", "off")),
        "auto",
        "under SLURM, requeue a preempted job once its checkpoint is saved (scontrol requeue): auto (on "
        "when checkpoint_dir is set), on or off",
    ),
    LOGGING,
    Setting(
        "verbose",
        kinds.BOOL,
        False,
        "also show torch's elastic agent logging on the terminal (always in RUN_DIR/logs/launcher.log)",
        L,
        bool_flag=True,
    ),
    Setting("run_dir", kinds.PATH, None, "directory for metrics and per-rank logs (default runs/<time>)"),
    Setting(
        "log_level",
        kinds.choice(("DEBUG", "INFO", "WARNING", "ERROR"), lambda t: t.strip().upper()),
        "INFO",
        "level of phalanx's own messages",
    ),
    Setting(
        "log_all_ranks", kinds.BOOL, False, "print phalanx's messages from every rank, not only rank 0", bool_flag=True
    ),
    Setting(
        "log_sinks",
        kinds.names_list(_sink_names),
        ["auto"],
        "where px.log() writes: auto (csv, jsonl, tensorboard if installed) or a list of csv, jsonl, tensorboard",
    ),
    Setting(
        "progress",
        kinds.choice(("auto", "on", "off")),
        "auto",
        "progress bar: auto (when stdout is a terminal), on or off",
    ),
    Setting(
        "trackers",
        kinds.names_list(_tracker_names),
        None,
        "experiment trackers px.log() also reaches, from the main process only: wandb, mlflow, swanlab, "
        "tensorboard (each a pip extra, e.g. phalanx[mlflow]); added to log_sinks",
    ),
    Setting(
        "step_anatomy",
        kinds.BOOL,
        True,
        "time each step's phases on every rank (data, forward, backward, optimizer, collectives, px.busy "
        "names), name stragglers and keep RUN_DIR/observe/status.json for phalanx top and --dashboard",
        bool_flag=True,
    ),
    Setting(
        "dashboard",
        kinds.Kind("address", _dashboard_address, lambda v: _dashboard_address(str(v))),
        None,
        "[HOST:]PORT: phalanx run serves a live page of the job from node 0 (default host 127.0.0.1; "
        "another host needs the token printed with the URL); needs starlette, uvicorn and plotly (pip install -e '.[dashboard]' in the clone)",
        L,
        env_name="PHALANX_DASHBOARD",
        value_name="[HOST:]PORT",
    ),
    Setting(
        "profile",
        kinds.Kind("step range", _step_range, lambda v: _step_range(str(v))),
        None,
        "START:STOP: trace optimizer steps START..STOP-1 with torch.profiler on every rank, one Chrome "
        "trace per rank in RUN_DIR/profile",
        value_name="START:STOP",
    ),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
RUNTIME: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.scope == Scope.RUNTIME)
LAUNCHER: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.scope == Scope.LAUNCHER)

# The resolved values: one frozen, typed object handed down to the modules that use them.
PhalanxConfig = dataclasses.make_dataclass(
    "PhalanxConfig",
    [(s.name, Any, dataclasses.field(default_factory=lambda s=s: _copy(s.default))) for s in SETTINGS],
    frozen=True,
    namespace={"__doc__": "Every setting's resolved value (see phalanx.config.schema.SETTINGS)."},
)
PhalanxConfig.__module__ = __name__


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def valid_keys() -> list[str]:
    return [s.name for s in SETTINGS]
