"""How fast a layout runs: a step-time model per rank, pure Python (no torch at import).

For a layout (a ParallelPlan), a transformer's shape and a device profile (plan/device_profiles.py):
- FLOPs per rank per step: model/flops.py's count per token x the tokens one model replica trains
  per step, split over its tp x cp x pp ranks; compute time = FLOPs / (peak x matmul efficiency);
- the bytes each collective moves per rank per step, named, from the ring formulas: all-reduce
  2(n-1)/n S, all-gather and reduce-scatter (n-1)/n S (S: the whole tensor's bytes);
- each collective's time: its bytes over the bandwidth of the link its group crosses (within a node
  when the group's ranks lie in one: the mesh puts tp innermost, then cp, dp_shard, dp_replicate, pp)
  plus a latency per call; data-parallel traffic hides under the backward up to `overlap`, the rest
  (tp, cp, pp) is exposed;
- the optimizer step: the bytes it reads and writes per parameter the rank steps, over the
  profile's memory bandwidth;
- step time = compute / (1 - bubble) + exposed communication + the optimizer step; tokens/s; MFU =
  model FLOPs / (step time x peak).

Assumptions, said once: the model's layers are split evenly over the pipeline ranks; each collective
of a layer runs once per layer per microbatch (latency) and moves the whole step's bytes in total;
tp's activation all-reduces (or sequence parallel's all-gather/reduce-scatter pairs, the same bytes)
are 2 forward + 2 backward per layer; cp exchanges keys and values per layer as an all-gather in the
forward and an all-gather + reduce-scatter (their gradients) in the backward; pp sends one
activation forward and one gradient back per stage per microbatch; zero3 (and hsdp) gathers each
unit's parameters in the forward and again in the backward. An MoE model's FLOPs count the experts
a token runs (top_k of them).

Not modelled: expert parallel's all-to-all (a dimension's figures come from its own package through
strategies/dimensions.py's hooks, which import torch), CPU offload's copies (those rows are left
out), and zero-bubble schedules' bubble (counted as none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.model.flops import TransformerShape
from phalanx.plan.device_profiles import DeviceProfile
from phalanx.strategies.pipeline import arithmetic
from phalanx.strategies.pipeline import schedules as pp_schedules
from phalanx.strategies.plan.parallel_plan import ParallelPlan, Sharding


def all_reduce_bytes(size: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `size` bytes over `n` ranks."""
    return 2 * (n - 1) / n * size


def all_gather_bytes(size: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) whose whole result is `size` bytes."""
    return (n - 1) / n * size


reduce_scatter_bytes = all_gather_bytes


@dataclass(frozen=True)
class Shape:
    """A transformer as the model needs it. `params`: every parameter (the gradients' and the
    optimizer's), `flops`: model/flops.py's count (weights outside the embedding tables).
    `tokens`: the tokens one data-parallel rank (one model replica: its tp x cp x pp ranks
    together) trains per step, `seq_len` each row's."""

    params: int
    flops: TransformerShape
    kv_width: int
    vocab: int
    seq_len: int
    tokens: int
    dtype_bytes: int = 2
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0
    """Every expert's weights together (MoE): a token runs top_k / experts of them."""
    optimizer_bytes: int = 28
    """Bytes the optimizer step reads and writes per parameter it steps (AdamW: the fp32 parameter,
    gradient and two moments read, three of them written)."""

    @property
    def layers(self) -> int:
        return self.flops.num_layers

    @property
    def width(self) -> int:
        return self.flops.width

    def flops_per_step(self) -> float:
        """One replica's model FLOPs per step (the active experts only)."""
        idle = self.expert_params * (1 - self.top_k / self.experts) if self.experts else 0
        active = TransformerShape(
            int(self.flops.num_params - idle),
            int(self.flops.num_trainable - idle),
            self.flops.num_layers,
            self.flops.width,
        )
        return active.flops_per_token(self.seq_len) * self.tokens


@dataclass(frozen=True)
class Collective:
    """One named collective's traffic per rank per step."""

    name: str
    bytes: float
    calls: int
    group: int
    within_node: bool
    seconds: float
    hidden: bool  # data-parallel traffic, which overlaps the backward


@dataclass(frozen=True)
class StepTime:
    flops: float
    """Model FLOPs one rank computes per step."""
    compute: float
    bubble: float
    exposed: float
    step: float
    tokens_per_second: float
    mfu: float
    collectives: list[Collective] = field(default_factory=list)
    optimizer: float = 0.0
    """Seconds of the optimizer step over the parameters (or shards) this rank steps."""

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.collectives)


@dataclass(frozen=True)
class Pipeline:
    schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int | None = None


def estimate(plan: ParallelPlan, shape: Shape, profile: DeviceProfile, pipeline: Pipeline = Pipeline()) -> StepTime:
    """The step-time model of `plan` for `shape` on `profile` (see the module's docstring)."""
    flops = shape.flops_per_step() * plan.flops_share  # one replica's, over its tp x cp x pp ranks
    compute = flops / profile.achievable_flops
    microbatches, bubble = _bubble(plan, pipeline)
    collectives = _collectives(plan, shape, profile, microbatches, pipeline)
    dp = sum(c.seconds for c in collectives if c.hidden)
    hideable = profile.overlap * compute * (1.0 if plan.sharding is Sharding.PARAMETERS else 2 / 3)
    exposed = sum(c.seconds for c in collectives if not c.hidden) + max(0.0, dp - hideable)
    optimizer = _optimizer_seconds(plan, shape, profile)
    step = compute / (1 - bubble) + exposed + optimizer
    return StepTime(
        flops,
        compute,
        bubble,
        exposed,
        step,
        shape.tokens * plan.dp_size / step,
        flops / (step * profile.peak_flops),
        collectives,
        optimizer,
    )


def _optimizer_seconds(plan: ParallelPlan, shape: Shape, profile: DeviceProfile) -> float:
    """The optimizer step, bound by memory: the bytes it touches over the rank's memory bandwidth. It
    steps one tp rank's part of its pipeline stage, and of that a 1/n slice under zero1 (n: the
    gradient ranks) and zero2/zero3/hsdp (n: the shard ranks)."""
    if not profile.memory_bandwidth:
        return 0.0
    slices = {Sharding.NONE: 1, Sharding.OPTIMIZER: plan.grad_size}.get(plan.sharding, plan.shard_ranks)
    return plan.stage_part(shape.params) / slices * shape.optimizer_bytes / profile.memory_bandwidth


def _bubble(plan: ParallelPlan, pipeline: Pipeline) -> tuple[int, float]:
    if plan.pp == 1:
        return 1, 0.0
    m = pipeline.microbatches or pp_schedules.default_microbatches(plan.pp)
    v = pp_schedules.stages_per_rank(pipeline.schedule, pipeline.stages_per_rank)
    bubble = arithmetic.bubble_fraction(pipeline.schedule, plan.pp, m, v)
    return m, bubble or 0.0  # zero-bubble schedules: not modelled, counted as none


def _collectives(
    plan: ParallelPlan, shape: Shape, profile: DeviceProfile, microbatches: int, pipeline: Pipeline
) -> list[Collective]:
    layers = plan.pp_part(shape.layers)  # one pipeline rank's layers
    out: list[Collective] = []

    def add(name: str, nbytes: float, calls: float, dims: tuple[str, ...], group: int, hidden: bool) -> None:
        if group < 2 or nbytes <= 0:
            return
        inside = plan.within_node(dims, profile.ranks_per_node)
        bandwidth, latency = (
            (profile.intra_bandwidth, profile.intra_latency)
            if inside
            else (profile.inter_bandwidth, profile.inter_latency)
        )
        calls = max(1, round(calls))
        out.append(Collective(name, nbytes, calls, group, inside, nbytes / bandwidth + calls * latency, hidden))

    _data_parallel(plan, shape, layers, add)
    # activations of one replica's tokens, each cp rank its part; every tp rank holds them whole
    act = plan.cp_part(shape.tokens) * shape.width * shape.dtype_bytes
    per_layer = layers * microbatches
    add("tp all-reduce (2 fwd + 2 bwd per layer)", 4 * layers * all_reduce_bytes(act, plan.tp), 4 * per_layer,
        ("tp",), plan.tp, False)  # fmt: skip
    kv = plan.tp_part(
        shape.tokens * 2 * shape.kv_width * shape.dtype_bytes
    )  # K and V of whole rows, one tp rank's heads
    add("cp K/V all-gather (fwd + bwd) + reduce-scatter (bwd)", 3 * layers * all_gather_bytes(kv, plan.cp),
        3 * per_layer, ("cp",), plan.cp, False)  # fmt: skip
    if plan.pp > 1:
        v = pp_schedules.stages_per_rank(pipeline.schedule, pipeline.stages_per_rank)
        add("pp send/recv (activation fwd + gradient bwd)", 2 * v * act, 2 * v * microbatches, ("pp",), plan.pp,
            False)  # fmt: skip
    return out


def _data_parallel(plan: ParallelPlan, shape: Shape, layers: float, add) -> None:  # noqa: ANN001
    """The gradient group's traffic: one tp rank's part of one pipeline rank's parameters."""
    size = plan.stage_part(shape.params * shape.dtype_bytes)
    units = max(1, round(layers))  # FSDP2 units: a block each; DDP's buckets, about as many
    if plan.sharding is Sharding.NONE:
        add("ddp gradient all-reduce", all_reduce_bytes(size, plan.grad_size), units,
            ("dp_replicate", "cp"), plan.grad_size, True)  # fmt: skip
        return
    if plan.sharding is Sharding.OPTIMIZER:
        dims = ("dp_replicate", "cp")
        add("zero1 gradient all-reduce", all_reduce_bytes(size, plan.grad_size), units, dims, plan.grad_size, True)
        add("zero1 parameter all-gather", all_gather_bytes(size, plan.grad_size), 16, dims, plan.grad_size, True)
        return
    n = plan.shard_ranks
    gathers = 2 if plan.sharding is Sharding.PARAMETERS else 1
    what = "fwd + bwd" if gathers == 2 else "once"
    add(f"{plan.preset} parameter all-gather ({what})", gathers * all_gather_bytes(size, n), gathers * units,
        ("dp_shard", "cp"), n, True)  # fmt: skip
    add(f"{plan.preset} gradient reduce-scatter", reduce_scatter_bytes(size, n), units, ("dp_shard", "cp"), n, True)
    add(f"{plan.preset} replicas' all-reduce of a shard", all_reduce_bytes(size / n, plan.dp_replicate), units,
        ("dp_replicate",), plan.dp_replicate, True)  # fmt: skip
