"""The words settings are made of, held by config itself (it imports nothing above it): strategy and
precision names with their aliases, tensor-parallel styles, pipeline schedules, and what a setting needs from the layout
to mean anything. strategies/ and loop/precision.py own the behaviour behind each word."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """What a strategy name stands for: a point of the parallel plan (strategies/plan/presets.py builds it)."""

    stage: int  # the ZeRO stage: what the data-parallel shard dim splits (parallel_plan.Sharding)
    holds: str  # what each rank holds, for the docs and `phalanx plan`
    hybrid: bool = False  # hsdp: replicas across nodes, shards within one
    threads_over_gpus: bool = False  # dp: one process, nn.DataParallel


AUTO = "auto"  # not a preset: decided from the model at prepare (strategies/auto.py)
SINGLE = "single"  # what a world of one runs, whatever was asked (one script, every scale)
# THE table of strategy names, in the order users read them in error messages: a preset, an
# alias of one (its name), or auto (None). Every other list of names derives from it.
STRATEGY_TABLE: dict[str, Preset | str | None] = {
    "dp": Preset(0, "everything, one process driving every visible GPU", threads_over_gpus=True),
    "ddp": Preset(0, "full model, gradients and optimizer state"),
    "zero1": Preset(1, "full model and gradients; 1/N of the optimizer state"),
    "zero2": Preset(
        2, "1/N of parameters, gradients and optimizer state; gathered parameters kept from forward to backward"
    ),
    "zero3": Preset(3, "1/N of everything; each block gathered only while it computes"),
    "fsdp": "zero3",
    AUTO: None,
    "hsdp": Preset(3, "zero3 within a node, replicated across nodes", hybrid=True),
    SINGLE: Preset(0, "everything, in one process"),
}
STRATEGIES: tuple[str, ...] = tuple(STRATEGY_TABLE)
STRATEGY_ALIASES: dict[str, str] = {name: to for name, to in STRATEGY_TABLE.items() if isinstance(to, str)}
PRESETS: dict[str, Preset] = {name: p for name, p in STRATEGY_TABLE.items() if isinstance(p, Preset)}
# The data-parallel presets of one process per device, by ZeRO stage (DeepSpeed's stages, Accelerate's FSDP)
BY_STAGE: dict[int, str] = {
    p.stage: name for name, p in PRESETS.items() if not p.hybrid and not p.threads_over_gpus and name != SINGLE
}
AUTO_CHOOSES: tuple[str, ...] = (BY_STAGE[0], BY_STAGE[3])  # auto: the same degrees, replicas or shards

# zero1's gather of the updated chunks: transient buckets (memory) or one persistent buffer (speed)
ZERO1_GATHER_MODES: tuple[str, ...] = ("bucketed", "persistent")
ZERO1_GRADS_MODES: tuple[str, ...] = ("all_reduce", "reduce_scatter")

PRECISIONS: tuple[str, ...] = ("no", "bf16", "fp16")
PRECISION_ALIASES: dict[str, str] = {"none": "no", "fp32": "no", "bfloat16": "bf16", "float16": "fp16"}


def canonical_strategy(name: str) -> str:
    """'FSDP ' -> 'zero3'; unknown names come back lower-cased, for the caller to refuse."""
    key = name.strip().lower()
    return STRATEGY_ALIASES.get(key, key)


def canonical_precision(name: str | None) -> str:
    key = (name or "no").strip().lower()
    return PRECISION_ALIASES.get(key, key)


# Where px.log() rows may go (log_sinks, trackers): files first, then experiment trackers;
# logging/sinks.py builds each and checks its registry holds exactly these.
METRICS_DESTINATIONS: tuple[str, ...] = ("csv", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")

# The styles a `tp_plan` may give a module (transformers' vocabulary, so a model's own plan reads as
# is); strategies/tensor_parallel.py maps each onto torch's ParallelStyle.
TP_STYLES: tuple[str, ...] = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "embedding_rowwise",
    "sequence_parallel",
    "replicate",
    "replicated_with_grad_allreduce",
    "local",
    "packed_colwise",
    "moe_tp_experts",
)
TP_STYLE_ALIASES: dict[str, str] = {
    "colwise_rep": "colwise_gather_output",
    "rowwise_rep": "rowwise_split_input",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
}


# torch's pipeline schedules (torch.distributed.pipelining), matched case-insensitively as torch does;
# strategies/pipeline/schedules.py says where each places its stages.
PP_SCHEDULES: tuple[str, ...] = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


def canonical_pp_schedule(name: str) -> str:
    """'gpipe ' -> 'GPipe'; unknown names come back stripped, for the caller to refuse."""
    key = name.strip()
    return {s.lower(): s for s in PP_SCHEDULES}.get(key.lower(), key)


class Needs(str, enum.Enum):
    """What a setting needs from the parallel layout to do anything. The plan answers whether it
    has it (strategies/plan/parallel_plan.py); a setting given where its need is missing is refused or
    warned by name, never silently ignored."""

    ALWAYS = "always"
    DDP = "DistributedDataParallel"  # ddp, zero1 without tensor parallel
    FSDP = "FSDP2"  # zero2, zero3, hsdp, and every data-parallel layout with tensor parallel
    ROW_SHARDED_EMBEDDINGS = "embeddings looked up where their rows live"  # zero2/zero3 on one mesh dim
    SHARDED_OPTIMIZER = "zero1's sharded optimizer state"  # zero1 over more than one data-parallel rank
    AUTO = "strategy auto"
    TENSOR_PARALLEL = "tensor parallel (tp > 1)"
    PIPELINE = "pipeline parallel (pp > 1)"
