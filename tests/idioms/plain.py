"""The one-process stand-in for `px` in the idiom corpus: each verb a corpus script calls, written as
plain torch does it with no phalanx (prepare returns its arguments, `forward_backward` is
`loss_fn(model(inputs), targets).backward()`, reduce and uneven_inputs do nothing). The reference
of every cell is the corpus script run with it, in one process; this module never imports phalanx."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn


class Plain:
    """What `px` is when the script runs as `python train.py` without phalanx."""

    rank = dp_rank = 0
    world_size = dp_size = 1
    is_main_process = True

    def prepare(self, *objects: Any) -> Any:
        return objects[0] if len(objects) == 1 else objects

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def forward_backward(
        self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor:
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss = loss_fn(out, targets)
        loss.backward()
        return loss.detach()

    def reduce(self, value: Any, reduction: str = "mean") -> Any:
        return value

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def uneven_inputs(self, *objects: Any) -> contextlib.AbstractContextManager["Plain"]:
        return contextlib.nullcontext(self)

    def iter(self, batches: Any) -> Any:
        """`uneven.iter(batches)`: the batches themselves."""
        return iter(batches)

    def wait_for_everyone(self) -> None:
        pass
