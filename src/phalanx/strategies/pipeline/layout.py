"""The pipeline dimension of a parallel plan applied first, as `parallelize` does under pp > 1: the
stages this rank runs are cut out of the user's model in place, before tensor parallel,
activation checkpointing, compile and the data-parallel wrapping apply to what is left.

What the later steps need from the whole model is taken before the cut: the tensor-parallel plan is
matched against every module (a pattern for another stage's layers is no typo), and a model on
the meta device keeps the order of all its modules, so this stage's modules draw the initial
values they draw in one process (model/meta_init.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from torch import nn

from phalanx.model import meta_init
from phalanx.strategies import tp_peft
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.plan.parallel_plan import ParallelPlan
from phalanx.strategies.pipeline import schedules
from phalanx.strategies import tied as tp_tied
from phalanx.strategies.pipeline import model_plan
from phalanx.strategies.pipeline.cut import PassThrough, RankStages, cut_model, stage_modules
from phalanx.strategies.pipeline.tied import TiedParam, find_tied
from phalanx.strategies.pipeline.split import Stages, split_for_schedule, stage_params


@dataclass
class PipelineCut:
    """One pipeline rank's part of the model, cut in place, and what the later steps need."""

    rank: RankStages
    """the cut model (this rank's units, pass-throughs elsewhere); its stage modules come later."""
    stages: Stages
    schedule: str
    num_microbatches: int
    init_order: list[nn.Module] | None
    """a meta model's modules before the cut, in registration order (None: not on meta)."""
    tp_layers: dict[str, str] | None
    """tp > 1: this rank's modules the tensor-parallel plan (matched on the whole model) names."""
    tied: list[TiedParam]
    """parameters held by the stages of more than one pipeline rank (their gradients are summed)."""
    outputs: model_plan.ModelOutputs | None = None
    """a transformers model: puts the last stage's logits back into the model's output class."""

    def stage_modules(self) -> tuple[nn.Module, ...]:
        """The module of each stage this rank runs, as the units are now."""
        return stage_modules(self.rank, self.stages)


def cut(model: nn.Module, plan: ParallelPlan, options: StrategyOptions, pp_rank: int) -> PipelineCut:
    """Cut `model` down to the stages pipeline rank `pp_rank` runs under `options.pp_schedule`.
    ValueError, the same on every rank, for a model, split or microbatch count that cannot run."""
    schedule = schedules.schedule_name(options.pp_schedule)
    per_rank = schedules.stages_per_rank(schedule)
    microbatches = options.pp_microbatches or schedules.default_microbatches(plan.pp)
    schedules.check_microbatches(schedule, plan.pp, microbatches)
    chain = model_plan.model_chain(model)
    stages = split_for_schedule(chain, plan, schedule, options.pp_split)
    tied = find_tied(model, chain, stages, schedule, plan)
    order = list(model.modules()) if meta_init.is_meta(model) else None
    tp_layers = None
    if plan.tp > 1:
        tp_layers = tp_peft.choose(model, options.tp_plan)  # a PEFT wrapper: the base model's plan inside it
        # tied across stages: both copies laid out alike, so their gradients sum element by element
        tp_layers = tp_tied.compatible_styles(model, tp_layers, tp_tied.tied_groups(model))
    outputs = model_plan.adapt_forward(model, chain) if model_plan.has_plan(model) else None
    rank = cut_model(model, chain, stages, schedules.stage_indices(schedule, pp_rank, plan.pp, per_rank), views=False)
    if tp_layers is not None:
        present, params = dict(model.named_modules()), dict(model.named_parameters())
        tp_layers = {
            name: style
            for name, style in tp_layers.items()  # params: an MoE's 3-D expert weights
            if (name in present and not isinstance(present[name], PassThrough)) or name in params
        }
    return PipelineCut(rank, stages, schedule, microbatches, order, tp_layers, tied, outputs)


def largest_rank_units(model: nn.Module, plan: ParallelPlan, options: StrategyOptions) -> tuple[str, ...]:
    """The units of the pipeline rank holding the most parameters, as `cut` would place them (for
    strategy auto, which sizes one rank's state before anything is cut)."""
    pp = plan.pp
    schedule = schedules.schedule_name(options.pp_schedule)
    per_rank = schedules.stages_per_rank(schedule)
    chain = model_plan.model_chain(model)
    stages = split_for_schedule(chain, plan, schedule, options.pp_split)
    counts = dict(zip(stages, stage_params(chain, stages)))
    ranks = [[stages[i] for i in schedules.stage_indices(schedule, r, pp, per_rank)] for r in range(pp)]
    largest = max(ranks, key=lambda held: sum(counts[stage] for stage in held))
    return tuple(unit for stage in largest for unit in stage)


def has_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def refuse_model_call_hint() -> str:
    return (
        "HINT: under pp > 1 train with px.forward_backward(model, inputs, targets, loss_fn) and evaluate "
        "with px.forward(model, inputs), which run the pipeline schedule over every stage"
    )
