"""peft's `save_pretrained` on a pipeline rank's PeftModel writes every stage's adapters, as one process.

peft finds a model's adapter weights by walking its adapter layers (the tuner's
`_get_adapter_state_dict`), so on a cut model it finds this stage's only, even when handed the whole
model's state dict, and it writes on every rank (`is_main_process` defaults to True) into the same
files: under pp 2 a tiny Llama's LoRA on q_proj/v_proj saved 4 of its 8 tensors, each rank over the
other. Here each stage asks peft for its own adapters (peft's names and filtering), the pipeline
ranks gather them, and global rank 0 runs peft's own `save_pretrained` (config, README, selected
adapters, safetensors) with peft's state-dict function answering the gathered whole.
"""

from __future__ import annotations

from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn


def answer_peft_save_pretrained(
    model: nn.Module, pp_group: Any, layout: str, check_every_rank_called: Callable[[str], None]
) -> bool:
    """Give a pipeline rank's PeftModel the whole model's save_pretrained; False for any other model.
    `check_every_rank_called(layout)` (save.py's, passed in: save.py imports this module) refuses a call
    that not every rank made."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return False
    # an instance attribute: the class stays
    model.save_pretrained = PeftSavePretrained(model, pp_group, layout, check_every_rank_called)
    return True


class PeftSavePretrained:
    """`save_pretrained` of a pipeline rank's PeftModel: peft's own, answered every stage's adapters."""

    def __init__(self, model: nn.Module, pp_group: Any, layout: str, check_every_rank_called: Callable[[str], None]):
        self.model = model
        self.check_every_rank_called = check_every_rank_called
        self.group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
        self.layout = layout

    def __call__(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        from peft import PeftModel, peft_model

        self.check_every_rank_called(self.layout)
        names = kwargs.get("selected_adapters") or list(self.model.peft_config)
        embeddings = kwargs.get("save_embedding_layers", "auto")
        whole = self._gathered({name: self._stage_adapter(name, embeddings) for name in names})
        result = None
        if dist.get_rank() == 0:

            def answer(model: nn.Module, state_dict: Any = None, adapter_name: str = "default", **_: Any) -> dict:
                return whole[adapter_name]

            with mock.patch.object(peft_model, "get_peft_model_state_dict", answer):
                result = PeftModel.save_pretrained(self.model, save_directory, *args, **kwargs)
        dist.barrier()  # every rank returns once rank 0 has written the files
        return result

    def _stage_adapter(self, name: str, embeddings: Any) -> dict[str, torch.Tensor]:
        from peft.utils import get_peft_model_state_dict

        own = type(self.model).state_dict(self.model)  # this stage's (the model's own state_dict() refuses under pp)
        state = get_peft_model_state_dict(self.model, own, adapter_name=name, save_embedding_layers=embeddings)
        # a stage sharded over its data-parallel ranks (FSDP2) holds DTensors: each rank of it gathers
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in state.items()}

    def _gathered(self, mine: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Every stage's adapters on pipeline rank 0 ({} elsewhere), per adapter name."""
        parts: list[Any] | None = [None] * dist.get_world_size(self.group) if dist.get_rank(self.group) == 0 else None
        dist.gather_object(mine, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        whole: dict[str, dict[str, torch.Tensor]] = {name: {} for name in mine}
        for part in parts or []:
            for name, state in part.items():
                whole[name].update(state)
        return whole
