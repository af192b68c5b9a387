"""zero1's optimizer: every parameter's optimizer state split evenly over ranks, row by row.

torch's ZeroRedundancyOptimizer gives each *whole* parameter to one rank, so a model whose
embedding is most of its bytes leaves that rank holding nearly all the optimizer state. Here each
rank owns the same dim-0 chunk of every parameter (torch.chunk's split, as FSDP2 shards), steps
the user's optimizer class on those chunks only, then all-gathers the updated chunks so every rank
holds the full parameters again. Gradients: on NCCL reduce-scattered to their chunks' owners (the
bytes of one all-reduce per step, with the gather; strategies/optimizers/zero1_grads.py); on gloo DDP
all-reduces them, which costs less CPU there than packing them for a reduce-scatter.

Memory: a chunk is a view of its parameter's own rows, so zero1 keeps no copy of the parameters;
what a rank holds at rest is the model, its gradients and 1/N of the optimizer state. The gather
goes through transient buckets (`gather="bucketed"`: 1/16 of the parameters' bytes each, within
1-64 MiB, cut by rows where a parameter is larger; strategies/optimizers/zero1_buckets.py; on gloo a parameter
of 64Ki elements or more goes straight into its rows, one broadcast per rank), or through one
persistent buffer of the whole model, gathered in one collective (`gather="persistent"`: a little
faster, at the parameters' bytes (padded to N equal chunks) held for good).

Checkpoints: `state_dict()` exposes each chunk's state as a DTensor sharded on dim 0 of the full
parameter, the layout zero3 (FSDP2) saves, so DCP checkpoints move between zero1, zero3, hsdp and
ddp in both directions.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from phalanx import host_only
from phalanx.config.names import ZERO1_GATHER_MODES as GATHER_MODES
from phalanx.runtime.collectives import all_gather_single
from phalanx.strategies.optimizers import zero1_buckets
from phalanx.strategies.optimizers.shared_groups import keeping_groups
from phalanx.strategies.optimizers.zero1_buckets import dim0_chunk


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (tensor parallel's part of a parameter; the same storage), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


class _Slot:
    """One parameter: its full tensor, this rank's chunk (a view of the full tensor's rows, stepped
    in place) and where that chunk sits in the buffer all ranks gather. Under tensor parallel the
    parameter is a DTensor and "full" means this rank's tensor-parallel part of it, which the
    data-parallel ranks share."""

    def __init__(self, param: nn.Parameter, world_size: int, rank: int):
        self.param = param
        with torch.no_grad():
            self.full = _local(param)  # what the data-parallel ranks chunk, step and gather
        self.replicated = self.full.dim() == 0  # a scalar cannot be split: every rank steps it
        rows = 1 if self.replicated else self.full.shape[0]
        self.row_numel = 1 if self.replicated else math.prod(self.full.shape[1:])
        self.rows_per_rank = rows if self.replicated else math.ceil(rows / world_size)
        self.start, self.end = (0, 1) if self.replicated else dim0_chunk(rows, world_size, rank)
        self.padded = self.rows_per_rank * self.row_numel  # numel this slot takes in a gather
        self.chunk = nn.Parameter(self._rows(), requires_grad=param.requires_grad)
        self._storage = self.full.data_ptr()  # what the chunk views

    def _rows(self) -> torch.Tensor:
        return self.full if self.replicated else self.full[self.start : self.end]

    def follow_param(self) -> None:
        """Re-point the chunk at the parameter's storage if the script replaced it
        (`param.data = ...`): the optimizer keeps its state, keyed by the same chunk."""
        current = _local(self.param)
        if current.data_ptr() != self._storage:  # (a plain parameter is its own `full`: its data moved)
            self.full, self._storage = current, current.data_ptr()
            self.chunk.data = self._rows()

    def grad_chunk(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is None:
            return None
        g = _local(g)
        return g if self.replicated else g[self.start : self.end]


class ShardedStateOptimizer(torch.optim.Optimizer, Joinable):
    """`optimizer_class` stepped on this rank's dim-0 chunk of every parameter, then all-gathered.

    `param_groups` hold the model's full parameters and the hyperparameters (what LR schedulers
    and DCP read); `optim` is the local optimizer over the chunks (what holds the state).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any = None,
        device_mesh: Any = None,
        gather: str = "bucketed",
        **defaults: Any,
    ):
        super().__init__(param_groups, defaults)
        Joinable.__init__(self)
        self.process_group = process_group
        # the 1-D mesh over process_group, built by every rank together beforehand: the state's
        # DTensors live on it. Built here, lazily, it would create a process group mid-training,
        # which hangs where ranks reach their optimizer step apart (pipeline stages).
        self._device_mesh = device_mesh
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears in more than one param group; zero1 shards each once")
        device = _local(params[0]).device if params else torch.device("cpu")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"zero1 needs one parameter dtype, got {sorted(map(str, dtypes))}. HINT: cast "
                "the model to one dtype before px.prepare (mixed precision is a setting)."
            )
        if gather not in GATHER_MODES:
            raise ValueError(f"zero1 gather {gather!r}: use one of {', '.join(GATHER_MODES)}")
        self.gather = gather
        self._gloo = host_only.engages(dist.get_backend(process_group))  # host-only: gloo's direct gathers
        self._device = device
        self._dtype = params[0].dtype if params else torch.float32
        self._slots: list[_Slot] = [_Slot(p, self.world_size, self.rank) for p in params]
        self._by_param: dict[nn.Parameter, _Slot] = {slot.param: slot for slot in self._slots}
        padded = sum(s.padded for s in self._slots)
        bucket = (
            padded
            if gather == "persistent"
            else max(
                1,
                zero1_buckets.bucket_bytes(padded * self.world_size * self._dtype.itemsize)
                // (self.world_size * self._dtype.itemsize),
            )
        )
        # gloo, bucketed: large parameters are gathered straight into their rows, the rest in buckets
        self._direct = zero1_buckets.gathered_directly(
            self._slots, self.world_size, self._gloo and gather == "bucketed"
        )
        direct = {id(s) for s in self._direct}
        self._buckets = zero1_buckets.plan_buckets([s for s in self._slots if id(s) not in direct], bucket)
        self._persistent: torch.Tensor | None = None
        if gather == "persistent":
            numel = self._buckets[0].numel if self._buckets else 0
            self._persistent = torch.zeros(numel * self.world_size, dtype=self._dtype, device=device)
        self.optim = optimizer_class(
            [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [self._by_param[p].chunk for p in g["params"]],
                }
                for g in self.param_groups
            ],
            **defaults,
        )

    def buffer_bytes(self) -> int:
        """Bytes this optimizer holds beyond the model, its gradients and the optimizer state:
        the persistent gather buffers, or nothing between steps when gathering in buckets."""
        held = self._persistent
        return 0 if held is None else held.numel() * held.element_size()

    # ---- the step --------------------------------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        for mine, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in mine.items():
                if key != "params":
                    local[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        Join.notify_join_context(self)
        self._sync_hyperparameters()
        for slot in self._slots:
            slot.follow_param()
            slot.chunk.grad = slot.grad_chunk()
        self.optim.step()
        for slot in self._slots:
            slot.chunk.grad = None  # a view of the full gradient: no second reference kept
        self.gather_params()
        if not self.state:
            self._refresh_state()  # non-empty from the first step on, as DCP expects
        return loss

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated chunks -> the full parameters on every rank (one all-gather per
        bucket, in place; one in all with the persistent buffer)."""
        zero1_buckets.gather_directly(self._direct, self.world_size, self.process_group)
        zero1_buckets.gather(
            self._buckets,
            self.world_size,
            self.rank,
            self._dtype,
            self._device,
            self.process_group,
            self._persistent,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optim"):
            raise NotImplementedError(
                "zero1 shards the optimizer's parameters once, at px.prepare; "
                "HINT: build the optimizer with every param group before prepare"
            )
        super().add_param_group(param_group)

    # ---- checkpoints: chunk state <-> DTensors over the full shapes -------------------------
    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if getattr(self, "_device_mesh", None) is None:
            ranks = (
                dist.get_process_group_ranks(self.process_group) if self.process_group else list(range(self.world_size))
            )
            self._device_mesh = DeviceMesh(self._device.type, ranks)
        return self._device_mesh

    def _as_global(self, slot: _Slot, value: Any, gather: bool) -> Any:
        """A chunk's state tensor as the whole parameter's: a DTensor sharded on dim 0 over the
        data-parallel ranks (no copy). Under tensor parallel (`gather`, checkpoints only) the
        chunks are gathered into this rank's tensor-parallel part and laid out as the parameter is."""
        from torch.distributed.tensor import DTensor, Shard

        if slot.replicated or not isinstance(value, torch.Tensor) or value.shape != slot.chunk.shape:
            return value  # e.g. AdamW's scalar `step`: the same on every rank
        if not isinstance(slot.param, DTensor):
            return DTensor.from_local(
                value, self._mesh(), [Shard(0)], run_check=False, shape=slot.param.shape, stride=slot.param.stride()
            )
        if not gather:
            return value
        padded = value.new_zeros(slot.rows_per_rank, *value.shape[1:])
        padded[: value.shape[0]] = value
        rows = value.new_empty(slot.rows_per_rank * self.world_size, *value.shape[1:])
        all_gather_single(rows, padded, group=self.process_group)
        return DTensor.from_local(
            rows[: slot.full.shape[0]],
            slot.param.device_mesh,
            slot.param.placements,
            run_check=False,
            shape=slot.param.shape,
            stride=slot.param.stride(),
        )

    def _refresh_state(self, gather: bool = False) -> None:
        """`state`, keyed by the full parameters: the chunks' state tensors wrapped."""
        self.state.clear()
        for slot in self._slots:
            local = self.optim.state.get(slot.chunk)
            if local:
                self.state[slot.param] = {k: self._as_global(slot, v, gather) for k, v in local.items()}

    def state_dict(self) -> dict[str, Any]:
        self._refresh_state(gather=True)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        with keeping_groups(self):
            super().load_state_dict(state_dict)
        for slot in self._slots:
            loaded = self.state.get(slot.param)
            if not loaded:
                continue
            local = {}
            for key, value in loaded.items():
                if isinstance(value, DTensor):
                    value = value.to_local()
                    if isinstance(slot.param, DTensor) and not slot.replicated:
                        value = value[slot.start : slot.end]  # this rank's tensor-parallel part, whole
                elif (
                    isinstance(value, torch.Tensor)
                    and not slot.replicated
                    and value.dim() > 0
                    and value.shape == slot.param.shape
                ):  # full tensors (from a ddp checkpoint)
                    value = value[slot.start : slot.end]
                local[key] = value.clone() if isinstance(value, torch.Tensor) else value
            self.optim.state[slot.chunk] = local
        self._refresh_state()
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})

    # ---- Join: a rank out of data still takes part in the others' all-gathers --------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _GatherJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD


class _GatherJoinHook(JoinHook):
    def __init__(self, optimizer: ShardedStateOptimizer):
        self.optimizer = optimizer

    def main_hook(self) -> None:
        """Step this rank's chunks with the gradients DDP's join hook (strategies/ddp.py) left
        from its peers' all-reduce, then gather: the rank out of data still owns its chunk of
        every parameter, which no other rank steps."""
        if any(slot.param.grad is not None for slot in self.optimizer._slots):
            self.optimizer.step()
            self.optimizer.zero_grad()
        else:
            self.optimizer.gather_params()


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.defaults` restricted to what its class's constructor accepts.

    (e.g. AdamW records `decoupled_weight_decay` in defaults but does not take it as an argument.)
    """
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def refuse_optimizer_with_state(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    if len(optimizer.state) > 0:
        raise ValueError(
            f"strategy {strategy!r} re-binds the optimizer's state to sharded parameters, but this "
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s). "
            "HINT: call px.prepare(model, optimizer) before the first optimizer.step() or "
            "load_state_dict(), and load optimizer state into the prepared optimizer."
        )
