"""Pipeline parallelism: a model cut into stages with its forward unchanged, run by torch's
schedules, composed with data parallelism per stage, checkpoints under the model's own names.

    chain = find_chain(model)                           # the units forward calls, checked
    stages = split_stages(chain, pp, pp_split)          # which units each stage owns
    rank = cut_model(model, chain, stages, stage_indices(schedule, pp_rank, pp, per_rank))
    modules = apply_fsdp(rank, mesh["dp_shard"])        # or apply_ddp(...), or rank.stages
    runner = PipelineRunner(modules, rank.stage_indices, rank.num_stages, mesh["pp"], device,
                            schedule, microbatches, loss_fn)
    loss = runner.step(inputs, targets)                 # every pipeline rank, same batch
"""
from phalanx.strategies.pipeline.arithmetic import PipelineFigures, bubble_fraction, in_flight, pipeline_figures
from phalanx.strategies.pipeline.chain import ModelChain, Unit, find_chain
from phalanx.strategies.pipeline.cut import PassThrough, RankStages, cut_model
from phalanx.strategies.pipeline.data_parallel import apply_ddp, apply_fsdp
from phalanx.strategies.pipeline.grads import clip_grad_norm_
from phalanx.strategies.pipeline.runner import PipelineRunner
from phalanx.strategies.pipeline.schedules import (
    SCHEDULES,
    check_microbatches,
    default_microbatches,
    last_stage_rank,
    schedule_name,
    stage_indices,
    stages_per_rank,
)
from phalanx.strategies.pipeline.split import Stages, split_stages, stage_params
from phalanx.strategies.pipeline.state import OPTIONS, gather_full_state_dict, get_state, set_state

__all__ = [
    "ModelChain", "OPTIONS", "PassThrough", "PipelineFigures", "PipelineRunner", "RankStages", "SCHEDULES", "Stages",
    "Unit", "apply_ddp", "apply_fsdp", "bubble_fraction", "check_microbatches", "clip_grad_norm_", "cut_model",
    "default_microbatches", "find_chain", "gather_full_state_dict", "get_state", "in_flight", "last_stage_rank",
    "pipeline_figures", "schedule_name", "set_state", "split_stages", "stage_indices", "stage_params",
    "stages_per_rank",
]
