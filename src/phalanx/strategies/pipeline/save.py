"""transformers' `save_pretrained` on a pipeline rank's model writes the whole model, as one process.

A rank's model holds its own stages' units only, so transformers' own `save_pretrained` would write
that part (stage 0's 10 of a 2-layer Llama's 21 tensors) as if it were the model. Under pp the cut
model's `save_pretrained` is replaced on the instance: every rank gathers the stages' weights
(state.py's `gather_full_state_dict`, a collective over the pipeline and, under FSDP2, each stage's
data-parallel ranks) and hands them to transformers' own method as `state_dict`; transformers writes
on global rank 0 only (`should_save_on_this_rank`), the config and generation config with them, and
every rank returns once the files are there. transformers' convention is to call it on every rank;
called on some ranks only, the gather would wait forever for the others, so the ranks first check
through the rendezvous store that all of them arrived (runtime/arrival.py), and refuse, naming px.get_state_dict, if not.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from torch import nn

from phalanx.runtime.arrival import every_rank_called
from phalanx.strategies.pipeline.state import gather_full_state_dict

ARRIVAL_WAIT_S = 30.0
"""How long a rank calling save_pretrained waits for the other ranks to call it too."""


class FullSavePretrained:
    """`save_pretrained` of a pipeline rank's model: transformers' own, given the whole model's weights."""

    def __init__(self, model: nn.Module, pp_group: Any, layout: str):
        self.model = model
        self.pp_group = pp_group
        self.layout = layout

    def __call__(self, save_directory: Any, *args: Any, state_dict: dict | None = None, **kwargs: Any) -> Any:
        save = type(self.model).save_pretrained  # transformers' own method, on this rank's (cut) model
        if state_dict is not None:  # the script gathered the weights itself (px.get_state_dict): no collective
            return save(self.model, save_directory, *args, state_dict=state_dict, **kwargs)
        self._check_every_rank_called()
        full = gather_full_state_dict(self.model, self.pp_group)  # the whole model on pipeline rank 0
        result = save(self.model, save_directory, *args, state_dict=full if dist.get_rank() == 0 else {}, **kwargs)
        dist.barrier()  # every rank returns once rank 0 has written the files
        return result

    def _check_every_rank_called(self) -> None:
        check_every_rank_called(self.layout)


def check_every_rank_called(layout: str) -> None:
    """Return once every rank called save_pretrained; ValueError naming the absent ranks if not."""
    every_rank_called(
        "save_pretrained",
        ARRIVAL_WAIT_S,
        lambda rank, absent: (
            f"save_pretrained on rank {rank}: under {layout} each rank holds its own pipeline stages only, "
            f"so writing the whole model gathers them from every rank, but rank(s) {absent} did not call "
            f"save_pretrained within {ARRIVAL_WAIT_S:g} s. HINT: call model.save_pretrained(dir) on every rank "
            "(transformers writes on rank 0 only), or gather the weights on every rank with "
            "state = px.get_state_dict(model) and pass them on the main process: "
            "model.save_pretrained(dir, state_dict=state)"
        ),
    )


def answer_save_pretrained(model: nn.Module, pp_group: Any, layout: str) -> None:
    """Give a pipeline rank's model, a transformers PreTrainedModel or a peft PeftModel
    (peft_save.py), the whole model's save_pretrained."""
    if "peft" in sys.modules:  # a PeftModel can only come from an imported peft
        from phalanx.strategies.pipeline.peft_save import answer_peft_save_pretrained

        if answer_peft_save_pretrained(model, pp_group, layout, check_every_rank_called):
            return
    if "transformers" not in sys.modules:  # then the model is no PreTrainedModel: nothing to import
        return
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        model.save_pretrained = FullSavePretrained(model, pp_group, layout)  # an instance attribute: the class stays
