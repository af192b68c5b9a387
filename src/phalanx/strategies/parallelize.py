"""`parallelize(model, layout)`: apply a parallel plan to a model, in torchtitan's fixed order:
pipeline stages cut -> tensor parallel -> activation checkpointing -> compile -> FSDP2 or DDP (or
DataParallel), then allocate a meta model's shards and initialise them.

Under pp > 1 the model is cut in place down to this rank's stages (strategies/pipeline/layout.py)
and the data-parallel wrapping applies to each stage module, over the data-parallel ranks that hold
the same stage; a `PipelineRunner` then drives the stages with the plan's schedule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from phalanx.loop.precision import Precision
from phalanx.model import init_replay, meta_init, router_balance
from phalanx.model.units import default_units, shard_units, transform_units
from phalanx.strategies import ddp, dp, fsdp, tensor_parallel, tp_fit, tp_peft
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.context.layout import local_padding
from phalanx.strategies.layout import Layout
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import layout as pipeline_layout
from phalanx.strategies.pipeline.cut import RankStages
from phalanx.strategies.pipeline.runner import PipelineRunner
from phalanx.strategies.pipeline.tied import TiedGradients


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
    pipeline: PipelineRunner | None = None  # pp > 1: what runs this rank's stages
    stages: RankStages | None = None  # pp > 1: the stages this rank runs
    other_units: tuple[str, ...] = ()  # pp > 1: the units of the other pipeline ranks' stages


def parallelize(
    model: nn.Module,
    layout: Layout,
    *,
    options: StrategyOptions,
    precision: Precision,
    device: torch.device,
    backend: str,
    after_tp: Callable[[nn.Module], None] | None = None,
) -> Parallelized:
    """The model laid out as `layout.plan` says, on `device`; in place except for the DDP/DataParallel
    wrapper it may come back in. Under pp > 1: this rank's stages, and the runner that drives them.
    `after_tp`: what runs on the model between tensor parallel and data parallel (ep x tp's split)."""
    plan = layout.plan
    fills = init_replay.recorded_fills(model) if meta_init.is_meta(model) else {}  # before shards replace them
    _refuse_before_cut(model, plan, options)
    cut = pipeline_layout.cut(model, plan, options, layout.mesh("pp").get_local_rank()) if plan.pp > 1 else None
    if cut is None and plan.grad_size > 1:  # an MoE router's load-balancing loss over the whole global batch
        router_balance.globalise(
            model, layout.group("grad"), cut_padding=local_padding if plan.cp > 1 else None, refusal=_router_refusal
        )
    tp_layers: dict[str, str] = {}
    if plan.tp > 1:
        chosen = cut.tp_layers if cut is not None else tp_peft.choose(model, options.tp_plan)
        tp_fit.check(model, plan, chosen)  # before anything is split: the sizes, not a crash in forward
        tp_layers = tensor_parallel.apply(
            model, layout.mesh("tp"), options.tp_plan, options.sequence_parallel, chosen=chosen
        )
    if after_tp is not None:
        after_tp(model)
    init_order = cut.init_order if cut is not None else None
    if plan.uses_fsdp:
        units = transform_units(
            model, shard_units(model, options.shard_modules), options.activation_checkpointing, options.compile, device
        )
        stages = cut.stage_modules() if cut is not None else (model,)
        # Not moved whole to the device first: fully_shard moves each unit's shards there, and a
        # meta model is allocated (shards only) and initialised after sharding.
        fsdp.apply(
            model,
            units,
            plan,
            layout.mesh("fully_shard"),
            options,
            precision,
            device,
            backend,
            roots=list(stages),
            init_order=init_order,
            fills=fills,
        )
        return _done(model, stages, Wrapper.FSDP, tp_layers, cut, layout, device)
    if meta_init.is_meta(model):  # replicated (or split by tensor parallel alone): allocate, initialise
        meta_init.materialize(model, device, options.init_weights, order=init_order, fills=fills)
    transform_units(model, default_units(model), options.activation_checkpointing, options.compile, device)
    model = model.to(device)
    if plan.threads_over_gpus:
        return Parallelized(dp.apply(model, precision, device), Wrapper.DATA_PARALLEL, tp_layers)
    stages = tuple(precision.wrap_forward(m) for m in (cut.stage_modules() if cut is not None else (model,)))
    if plan.uses_ddp:
        # Under pp, torch's stage runs its first (shape-finding) microbatch outside no_sync: DDP must
        # look for unused parameters, or the next new input shape fails in its reducer (docs/pipeline.md).
        group = layout.group("grad")
        # zero1 outside pipelines, where asked: gradients reduce-scattered to their owners (zero1_grads.py)
        scatter = plan.shards_optimizer_only and cut is None and options.zero1_grads == "reduce_scatter"
        stages = tuple(
            ddp.apply(m, options, device, group, find_unused_parameters=cut is not None or None, scatter_grads=scatter)
            if pipeline_layout.has_params(m)
            else m
            for m in stages
        )
        return _done(model, stages, Wrapper.DDP, tp_layers, cut, layout, device)
    return _done(model, stages, Wrapper.NONE, tp_layers, cut, layout, device)


def _refuse_before_cut(model: nn.Module, plan: ParallelPlan, options: StrategyOptions) -> None:
    """ValueError, before the model is cut into stages (its config is still the whole model's), for
    what a pipeline cannot train as one process does."""
    if plan.pp > 1 and plan.tp > 1 and options.sequence_parallel:
        raise ValueError(
            f"sequence_parallel with pp={plan.pp} x tp={plan.tp}: a pipeline stage's first block would take the "
            "previous stage's sequence-split activations as whole ones (not built nor tested). HINT: leave "
            "sequence_parallel off under pp, or use tp with a data-parallel layout for sequence parallel"
        )
    router_refusal = router_balance.pipeline_refusal(model, plan.pp)
    if router_refusal is not None:
        raise ValueError(router_refusal)


def _router_refusal() -> str | None:
    """Why an MoE router's global load-balancing loss cannot run now: inside torch's Join, whose
    finished ranks shadow DDP's all-reduces only, a forward's own collectives would meet none."""
    from phalanx.data.uneven import current_join

    if current_join() is None:
        return None
    return (
        "an MoE model's router load-balancing loss (output_router_logits=True) sums its statistics over "
        "the data-parallel ranks in every training forward, which torch's Join (px.uneven_inputs under "
        "ddp or zero1) cannot shadow for a rank that ran out of batches. HINT: use "
        "px.uneven_inputs(model, method='agree') (every rank stops at the shortest), or give every rank "
        "as many batches (drop_last=True), or train without the router loss (output_router_logits=False)."
    )


def _done(
    model: nn.Module,
    stages: tuple[nn.Module, ...],
    wrapper: Wrapper,
    tp_layers: dict[str, str],
    cut: pipeline_layout.PipelineCut | None,
    layout: Layout,
    device: torch.device,
) -> Parallelized:
    """What prepare returns: the (wrapped) model, or under pp the rank's model with a runner over its
    stage modules (the wrapped model itself when this rank runs one stage)."""
    if cut is None:
        return Parallelized(stages[0], wrapper, tp_layers)
    runner = PipelineRunner(
        stages,
        cut.rank.stage_indices,
        cut.rank.num_stages,
        layout.mesh("pp"),
        device,
        cut.schedule,
        cut.num_microbatches,
    )
    runner.refuse_direct_calls(model, hint=pipeline_layout.refuse_model_call_hint())
    if cut.outputs is not None:
        runner.model_output = cut.outputs.wrap
    if cut.tied:
        runner.tied = TiedGradients(model, cut.tied, layout)
    returned = stages[0] if len(stages) == 1 else model
    others = tuple(unit for stage in cut.stages for unit in stage if unit not in cut.rank.units)
    return Parallelized(returned, wrapper, tp_layers, runner, cut.rank, others)
