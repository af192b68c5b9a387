"""The parallel plan: one frozen description of how a job is laid out over its processes.

A layout is a point in a space of dimensions, as torchtitan's `ParallelDims` and Accelerate's
`ParallelismConfig` describe it: pipeline stages (pp), data-parallel replicas (dp_replicate) and
shards (dp_shard), and tensor-parallel ranks (tp), whose product is the number of processes; plus
what the data-parallel dims shard (nothing, the optimizer state, + gradients, + parameters), and the
options of that sharding. Strategy names (ddp, zero1, zero2, zero3, hsdp, dp) are presets that
build a plan (strategies/plan/presets.py). Every question "does this layout use DDP / FSDP2 / meta
init / this setting?" is a property of the plan, so no list of strategy names exists elsewhere.

Pure Python (no torch): `phalanx run` builds the plan and checks the settings against it before
any worker starts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from phalanx.config.names import Needs

# The mesh's dimensions, outermost first (torchtitan's order): ranks next to each other share a
# tensor-parallel group, the fastest links; pipeline stages are furthest apart.
# Context parallel (cp) sits between the data-parallel dims and tp, as in torchtitan: its ranks
# exchange keys and values on every layer, less often than tensor parallel's all-reduces.
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Every degree a setting of the same name gives: the mesh's dims, and expert parallel (ep), which
# takes its ranks from the gradient ranks (data-parallel x cp, torchtitan's "ep borrows from
# dp_shard x cp") instead of multiplying the world, so it is no dim of the mesh.
DEGREES: tuple[str, ...] = (*MESH_DIMS, "ep")


class Sharding(enum.IntEnum):
    """What the data-parallel shard dimension splits over its ranks (the ZeRO stage)."""

    NONE = 0  # every rank holds everything: gradients all-reduced (ddp)
    OPTIMIZER = 1  # optimizer state split over the data-parallel ranks; parameters and gradients whole (zero1)
    GRADIENTS = 2  # + gradients and parameters at rest; gathered ones kept from forward to backward (zero2)
    PARAMETERS = 3  # + each unit's gathered parameters freed after its forward (zero3)


@dataclass(frozen=True)
class ParallelPlan:
    """A layout: the degrees of each mesh dimension and what the data-parallel dims shard."""

    preset: str
    """The strategy name the plan was built from (ddp, zero1, zero2, zero3, hsdp, dp, single)."""
    dp_replicate: int = 1
    """Data-parallel replicas: gradients (or gradient shards) are all-reduced across them."""
    dp_shard: int = 1
    """Data-parallel ranks the `sharding` stage splits model state over."""
    tp: int = 1
    """Tensor-parallel ranks: each layer of the tensor-parallel plan is split over them."""
    pp: int = 1
    """Pipeline ranks: the model's blocks cut into consecutive stages, one (or, interleaved, a few)
    per pipeline rank; activations go point to point from stage to stage."""
    sharding: Sharding = Sharding.NONE
    cp: int = 1
    """Context-parallel ranks: each row's sequence cut over them; they read the same rows, and
    gradients are averaged (or parameters sharded) over the data-parallel and cp ranks together."""
    ep: int = 1
    """Expert-parallel ranks: each MoE layer's experts split over them, each token sent to its
    experts' rank and back (all-to-all). Taken from the gradient ranks (data-parallel x cp): the
    non-expert parameters stay data parallel over them; the experts are replicated over the
    `ep_replicate` groups of ep ranks."""
    cpu_offload: bool = False
    """zero3: sharded parameters, gradients and optimizer state live in CPU memory."""
    threads_over_gpus: bool = False
    """dp: one process drives every visible GPU with nn.DataParallel."""

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel plan: {name}={value!r} must be a positive whole number")
        if not isinstance(self.ep, int) or self.ep < 1 or self.grad_size % self.ep:
            raise ValueError(
                f"parallel plan: ep={self.ep!r} must be a positive whole number dividing the "
                f"{self.grad_size} data-parallel x cp ranks it takes its ranks from"
            )
        if self.sharding < Sharding.GRADIENTS and self.dp_shard > 1:
            # parameters and gradients stay whole: every data-parallel rank is a replica (zero1
            # splits only its optimizer state, over all of them)
            raise ValueError(
                f"parallel plan: dp_shard={self.dp_shard} with sharding {self.sharding.name}: "
                "parameters are not sharded, so the data-parallel ranks are replicas (dp_replicate)"
            )

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that read different data: the data-parallel dims."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_size(self) -> int:
        """Ranks whose gradients are averaged into one step: the data-parallel ranks x cp."""
        return self.dp_size * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks one parameter's shards spread over: FSDP2's shard dim (dp_shard x cp, torchtitan's)."""
        return self.dp_shard * self.cp

    @property
    def stage_ranks(self) -> int:
        """Ranks one pipeline stage's state is spread over: every dim but pp."""
        return self.world_size // self.pp

    @property
    def flops_share(self) -> float:
        """The part of a step's model FLOPs one rank computes: tensor parallel, cp and pipeline stages
        split them, data-parallel ranks repeat them."""
        return self.dp_size / self.world_size

    @property
    def cp_chunks(self) -> int:
        """The chunks each row's sequence is cut into: cp rank i holds chunks i and 2cp-1-i (load balance)."""
        return 2 * self.cp

    def tp_within(self, local_world_size: int) -> bool:
        """Whether each tensor-parallel group lies inside one node of `local_world_size` processes (tp is
        the innermost dim, so it does when tp divides the node's processes)."""
        return local_world_size % self.tp == 0

    def tp_part(self, nbytes: int) -> int:
        """`nbytes` split evenly over the tensor-parallel ranks (an estimate: layers the tp plan leaves
        whole are not split)."""
        return nbytes // self.tp

    # ---- the step-time model's shares (plan/step_time.py) ----------------------------------
    def stage_part(self, amount: float) -> float:
        """One rank's part of `amount` spread over a replica's pipeline stages and tensor-parallel ranks
        (parameters, their gradients): amount / (tp x pp)."""
        return amount / (self.tp * self.pp)

    def pp_part(self, amount: float) -> float:
        """One pipeline rank's part of `amount` (the model's layers), split evenly."""
        return amount / self.pp

    def cp_part(self, amount: float) -> float:
        """One context-parallel rank's part of `amount` (a replica's tokens)."""
        return amount / self.cp

    def within_node(self, dims: tuple[str, ...], ranks_per_node: int) -> bool:
        """Whether a group over the mesh dims `dims` lies in one node of `ranks_per_node` ranks: the span
        of its ranks (its own degrees times the strides of the dims inside them) fits the node."""
        outer = min(MESH_DIMS.index(d) for d in dims)
        span = 1
        for name in MESH_DIMS[outer:]:
            span *= getattr(self, name)
        return span <= ranks_per_node

    @property
    def ep_replicate(self) -> int:
        """Copies of each expert: the groups of `ep` ranks the gradient ranks hold."""
        return self.grad_size // self.ep

    def cp_rank(self, rank: int) -> int:
        """Which part of each row's sequence `rank` holds."""
        return self.coordinates(rank)["cp"]

    def degrees(self) -> dict[str, int]:
        """Every mesh dimension's size, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major over MESH_DIMS)."""
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel rank `rank` is: its shard of the data."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ---- what the layout uses --------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def uses_fsdp(self) -> bool:
        """FSDP2 `fully_shard` over the data-parallel dims: sharded stages, and every data-parallel
        layout composed with tensor parallel (torch composes TP with FSDP2, not with DDP)."""
        if self.grad_size == 1:
            return False
        return self.sharding >= Sharding.GRADIENTS or self.tp > 1

    @property
    def uses_ddp(self) -> bool:
        """DistributedDataParallel over the data-parallel dims: ddp and zero1 without tensor parallel."""
        return self.grad_size > 1 and not self.uses_fsdp and not self.threads_over_gpus

    @property
    def shards_parameters(self) -> bool:
        """Parameters are DTensors split over ranks at rest (FSDP2's, or tensor parallel's)."""
        return (self.uses_fsdp and self.sharding >= Sharding.GRADIENTS) or self.tp > 1

    @property
    def frees_gathered_blocks(self) -> bool:
        """zero2, zero3, hsdp: each unit's parameters are gathered for a step and freed after it, so a
        step frees block-sized buffers over and over (tensor parallel alone gathers nothing)."""
        return self.uses_fsdp and self.sharding >= Sharding.GRADIENTS

    @property
    def reshard_after_forward(self) -> bool:
        """zero3 frees a unit's gathered parameters after its forward; zero2 keeps them for backward.
        Under pp neither does (torchtitan's choice): a stage runs a forward per microbatch, and
        freeing after each would gather the parameters again for every microbatch's backward; they
        are sharded between steps all the same."""
        return self.sharding >= Sharding.PARAMETERS and self.pp == 1

    @property
    def partial_gradients(self) -> bool:
        """Each rank holds the gradients of part of the model only (FSDP2's shards, tensor parallel's
        parts, its pipeline stages): fp16's skip-the-step decision must be agreed over all ranks."""
        return self.shards_parameters or self.pp > 1

    @property
    def shards_optimizer_only(self) -> bool:
        """zero1: phalanx's sharded-state optimizer over the data-parallel ranks."""
        return self.sharding is Sharding.OPTIMIZER and self.grad_size > 1

    @property
    def builds_on_meta(self) -> bool:
        """A model built under `px.init_module()` stays on the meta device until prepare, which
        allocates only this rank's shards (or pipeline stages)."""
        return self.shards_parameters or self.pp > 1

    def has(self, need: Needs) -> bool:
        """Whether this layout gives a setting what it needs to do anything."""
        if need is Needs.ALWAYS:
            return True
        if need is Needs.DDP:
            return self.uses_ddp
        if need is Needs.FSDP:
            return self.uses_fsdp
        if need is Needs.ROW_SHARDED_EMBEDDINGS:
            # one data-parallel mesh dim, shards in device memory, no tensor parallel
            return (
                self.uses_fsdp
                and self.sharding >= Sharding.GRADIENTS
                and self.dp_replicate == 1
                and self.tp == 1
                and not self.cpu_offload
            )
        if need is Needs.SHARDED_OPTIMIZER:
            return self.shards_optimizer_only
        if need is Needs.TENSOR_PARALLEL:
            return self.tp > 1
        if need is Needs.PIPELINE:
            return self.pp > 1
        if need is Needs.AUTO:
            return False  # a plan is what auto decided, never auto itself
        raise ValueError(f"unknown need {need!r}")

    def describe(self) -> str:
        """One line for logs and errors: `zero3: dp_shard 2 x tp 2 (4 processes)`."""
        dims = [f"{name} {size}" for name, size in self.degrees().items() if size > 1]
        extra = (f", experts over ep {self.ep}" if self.ep > 1 else "") + (", CPU offload" if self.cpu_offload else "")
        return f"{self.preset}: {' x '.join(dims) or 'one process'}{extra} ({self.world_size} process(es))"
