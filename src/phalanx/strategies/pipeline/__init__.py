"""Pipeline parallelism: a model cut into stages with its forward unchanged, run by torch's
schedules, composed with data parallelism per stage, checkpoints under the model's own names.

    chain = find_chain(model)                           # the units forward calls, checked
    stages = split_stages(chain, pp, pp_split)          # which units each stage owns
    rank = cut_model(model, chain, stages, stage_indices(schedule, pp_rank, pp, per_rank))
    modules = rank.stages                               # each in DDP or FSDP2 (parallelize does it for Phalanx)
    runner = PipelineRunner(modules, rank.stage_indices, rank.num_stages, mesh["pp"], device,
                            schedule, microbatches, loss_fn)
    loss = runner.step(inputs, targets)                 # every pipeline rank, same batch

The names below load their module on first use (PEP 562): `schedules` and `arithmetic` are pure
Python, and `phalanx run` checks pipeline settings with them without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "arithmetic": ("PipelineFigures", "bubble_fraction", "in_flight", "pipeline_figures"),
    "chain": ("ModelChain", "Unit", "find_chain"),
    "cut": ("PassThrough", "RankStages", "cut_model"),
    "grads": ("clip_grad_norm_",),
    "runner": ("PipelineRunner",),
    "schedules": (
        "SCHEDULES",
        "check_microbatches",
        "default_microbatches",
        "last_stage_rank",
        "microbatches_for",
        "schedule_name",
        "stage_indices",
        "stages_per_rank",
    ),
    "split": ("Stages", "split_stages", "stage_params"),
    "state": ("OPTIONS", "gather_full_state_dict", "get_state", "set_state"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    if name in _HOMES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
