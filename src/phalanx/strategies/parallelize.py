"""`parallelize(model, plan, mesh)`: apply a parallel plan to a model, in torchtitan's fixed order:
tensor parallel -> activation checkpointing -> compile -> FSDP2 or DDP (or DataParallel), then
allocate a meta model's shards and initialise them. (Pipeline stages will be cut before all that.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phalanx.loop.precision import Precision
from phalanx.model import meta_init
from phalanx.model.units import default_units, shard_units, transform_units
from phalanx.strategies import ddp, dp, fsdp, tensor_parallel
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.parallel_plan import ParallelPlan


class Wrapper(enum.Enum):
    """What holds the data-parallel gradient sync of a prepared model."""

    NONE = "none"  # one process, or tensor parallel alone
    DDP = "DistributedDataParallel"
    FSDP = "FSDP2"
    DATA_PARALLEL = "DataParallel"


@dataclass
class Parallelized:
    model: nn.Module
    wrapper: Wrapper
    tp_layers: dict[str, str]  # module name -> tensor-parallel style applied


def dp_mesh(mesh: Any, plan: ParallelPlan) -> Any:
    """The mesh FSDP2 works over: the shard dim alone, or replicate x shard (hsdp, and replicas
    composed with tensor parallel)."""
    return mesh["dp_replicate", "dp_shard"] if plan.dp_replicate > 1 else mesh["dp_shard"]


def dp_group(mesh: Any, plan: ParallelPlan) -> Any:
    """The process group of the data-parallel ranks (None: every rank, no tensor parallel)."""
    if mesh is None or plan.dp_size == plan.world_size:
        return None
    dims = [d for d in ("dp_replicate", "dp_shard") if getattr(plan, d) > 1] or ["dp_shard"]
    return mesh[tuple(dims)]._flatten("dp").get_group() if len(dims) > 1 else mesh[dims[0]].get_group()


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: Any, *, options: StrategyOptions, precision: Precision,
                device: torch.device, backend: str) -> Parallelized:
    """The model laid out as `plan` says, on `device`; in place except for the DDP/DataParallel
    wrapper it may come back in."""
    tp_layers: dict[str, str] = {}
    if plan.tp > 1:
        tp_layers = tensor_parallel.apply(model, mesh["tp"], options.tp_plan, options.sequence_parallel)
    if plan.uses_fsdp:
        units = transform_units(model, shard_units(model, options.shard_modules), options.activation_checkpointing,
                                options.compile, device)
        # Not moved whole to the device first: fully_shard moves each unit's shards there, and a
        # meta model is allocated (shards only) and initialised after sharding.
        fsdp.apply(model, units, plan, dp_mesh(mesh, plan), options, precision, device, backend)
        return Parallelized(model, Wrapper.FSDP, tp_layers)
    if meta_init.is_meta(model):  # replicated (or split by tensor parallel alone): allocate, initialise
        meta_init.materialize(model, device, options.init_weights)
    transform_units(model, default_units(model), options.activation_checkpointing, options.compile, device)
    model = model.to(device)
    if plan.threads_over_gpus:
        return Parallelized(dp.apply(model, precision, device), Wrapper.DATA_PARALLEL, tp_layers)
    model = precision.wrap_forward(model)
    if plan.uses_ddp:
        return Parallelized(ddp.apply(model, options, device, dp_group(mesh, plan)), Wrapper.DDP, tp_layers)
    return Parallelized(model, Wrapper.NONE, tp_layers)
