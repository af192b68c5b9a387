"""Under tensor parallel, every parameter of the model is a DTensor on the tp mesh, as torchtitan
lays models out: the layers a plan splits hold Shard() parameters, everything else (norms, an
unsplit embedding, biases of replicated layers) holds Replicate() ones. torch's own utilities then
see one kind of tensor (`torch.nn.utils.clip_grad_norm_`, `clip_grad_value_`, foreach optimizers,
fp16's unscale), where a mix of DTensors and plain tensors fails with "got mixed torch.Tensor and
DTensor".

A replicated module takes its plain inputs as DTensors on the mesh and hands its outputs back as
plain tensors, so the modules around it see what they saw before. How an input is taken:
- `Replicate()` (the `replicate` style, and every module no plan entry names): each rank holds
  the same activation, so each rank's parameter gradient is already the whole one;
- `Shard(0)` (transformers' `replicated_with_grad_allreduce`, e.g. Gemma3's per-head q/k norms):
  each rank holds its own heads, so the parameter's gradient is the sum of the ranks' parts,
  which DTensor reduces (a Partial gradient) when the gradient is read or stepped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _make_style(shard_input: bool) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicateParallel(ParallelStyle):
        """The module's own parameters (and buffers) as Replicate() DTensors; plain tensor inputs
        taken as Shard(0) or Replicate() DTensors; DTensor outputs handed back local."""

        def __init__(self) -> None:
            super().__init__()
            self.input_layout = Shard(0) if shard_input else Replicate()

        def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
            if name:  # only the module's own tensors: its children are laid out by their own entries
                return
            for pname, param in list(module.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    dt = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
                    module.register_parameter(pname, nn.Parameter(dt, requires_grad=param.requires_grad))
            for bname, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and not isinstance(buf, DTensor) and buf.is_floating_point():
                    persistent = bname not in module._non_persistent_buffers_set
                    module.register_buffer(
                        bname, DTensor.from_local(buf, mesh, [Replicate()], run_check=False), persistent=persistent
                    )

        def _inputs(self, module: nn.Module, args: Any, mesh: Any) -> Any:
            return tuple(
                DTensor.from_local(a, mesh, [self.input_layout], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        @staticmethod
        def _outputs(module: nn.Module, outputs: Any, mesh: Any) -> Any:
            if isinstance(outputs, DTensor):
                return outputs.to_local()
            if isinstance(outputs, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
            return outputs

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)

    return ReplicateParallel()


def replicate_style(style: str) -> Any:
    """torch's ParallelStyle for transformers' replicated styles (`replicate`,
    `replicated_with_grad_allreduce`); None for any other."""
    if style == "replicate":
        return _make_style(shard_input=False)
    if style == "replicated_with_grad_allreduce":
        return _make_style(shard_input=True)
    return None


def replicate_rest(model: nn.Module, tp_mesh: Any, skip: set[str]) -> list[str]:
    """Make every module that still holds plain parameters a replicated one (Replicate() inputs);
    `skip`: modules left as they are (`local` style). Returns the names of the modules changed."""
    from torch.distributed.tensor import DTensor

    names = []
    for name, module in model.named_modules():
        if name not in skip and any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            _make_style(shard_input=False)._apply(module, tp_mesh)
            names.append(name)
    return names
