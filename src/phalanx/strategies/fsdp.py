"""ZeRO-2 and ZeRO-3 on FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded
over ranks, one wrapping unit per block so only one block's full parameters exist at a time.

zero3 frees each unit's gathered parameters after its forward (gathered again in backward);
zero2 keeps them from forward to backward (less communication, more memory during the step).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from phalanx.runtime.context import DistContext
from phalanx.model.units import shard_units
from phalanx.strategies.base import StrategyOptions
from phalanx.strategies.gloo_comms import use_all_reduce_for_gradients
from phalanx.loop.precision import Precision
from phalanx.strategies.zero1 import refuse_optimizer_with_state

def prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Use the multi-tensor (foreach) step where the user left `foreach` unset. torch picks the
    per-parameter loop on CPU, and over FSDP2's DTensor parameters every one of its ~8 ops per
    parameter pays DTensor's dispatch: measured on bench/strategies.py's encoder (51 parameters),
    AdamW's step went from 21 to 13 ms CPU. An explicit foreach=False is kept."""
    if "foreach" not in optimizer.defaults:
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is None:
            group["foreach"] = True


class FSDPStrategy:
    """zero3 (also named fsdp): full sharding; `cpu_offload` keeps shards in CPU memory."""

    name = "zero3"
    reshard_after_forward = True

    def __init__(self, ctx: DistContext, options: StrategyOptions | None = None):
        self.ctx = ctx
        self.options = options or StrategyOptions()
        self.precision = Precision(self.options.mixed_precision, ctx.device, sharded=True)
        # id(original parameter) -> (weak ref to it, its sharded replacement), for the optimizer.
        self._rebind: dict[int, tuple[weakref.ref, nn.Parameter]] = {}

    def device_mesh(self) -> Any:
        """The mesh parameters are sharded over: every rank (hsdp overrides it with a 2-D one)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))

    def _fsdp_kwargs(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        mesh = self.device_mesh()
        offload = (CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
                   if self.options.cpu_offload else OffloadPolicy())
        return {"mesh": mesh, "mp_policy": self.precision.fsdp_policy(), "offload_policy": offload}

    def setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from phalanx.model import meta_init
        from phalanx.model.units import transform_units

        # Not moved whole to the device first: fully_shard moves each unit's shards there, and a
        # meta model is allocated (shards only) and initialised after sharding.
        meta = meta_init.is_meta(model)
        units = transform_units(model, shard_units(model, self.options.shard_modules),
                                self.options.activation_checkpointing, self.options.compile, self.ctx.device)
        before = {name: p for name, p in model.named_parameters()}
        kwargs = self._fsdp_kwargs()
        looked_up = self._shard_embeddings(model, units, kwargs["mesh"])
        if looked_up:
            kwargs["ignored_params"] = {e.weight for e in looked_up}
        nested = any(a is not b and any(m is b for m in a.modules()) for a in units for b in units)
        for i, unit in reversed(list(enumerate(units))):  # inner units first when nested
            # The last unit runs first in backward: freeing it after forward only to gather it
            # again at once is wasted communication.
            last = i == len(units) - 1
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward and not last, **kwargs)
        fully_shard(model, reshard_after_forward=False, **kwargs)
        use_all_reduce_for_gradients([*units, model], self.ctx.backend)  # gloo: cheaper than its reduce-scatter
        prefetch = self.options.forward_prefetch is not False  # default on (see StrategyOptions)
        if prefetch and not nested and len(units) > 1:
            for i in range(len(units) - 1):
                units[i].set_modules_to_forward_prefetch([units[i + 1]])
            if self.reshard_after_forward:  # zero2 has nothing to gather again in backward
                for i in range(1, len(units)):
                    units[i].set_modules_to_backward_prefetch([units[i - 1]])
        if meta:
            meta_init.materialize(model, self.ctx.device, self.options.init_weights,
                                  param_device=torch.device("cpu") if self.options.cpu_offload else None)
        after = dict(model.named_parameters())
        for name, old in before.items():
            self._rebind[id(old)] = (weakref.ref(old), after[name])
        return model

    def _shard_embeddings(self, model: nn.Module, units: list[nn.Module], mesh: Any) -> list[nn.Module]:
        """Root-level embedding tables kept sharded by rows, looked up where the rows live; FSDP2
        leaves them alone. Not on a 2-D (hsdp) mesh, nor with CPU offload."""
        from phalanx.strategies import sharded_embedding

        if self.options.embedding_exchange != "auto" or mesh.ndim != 1 or self.options.cpu_offload:
            return []
        tables = sharded_embedding.eligible(model, units)
        for table in tables:
            sharded_embedding.shard(table, mesh, self.ctx.device)
        return tables

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None) -> torch.optim.Optimizer:
        """Point the optimizer's groups at the sharded parameters, in place: same object, same
        hyperparameters and groups; its state is created on the shards at the first step."""
        refuse_optimizer_with_state(optimizer, self.name)
        sharded = {id(new) for _, new in self._rebind.values()}
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if id(p) in sharded:
                    params.append(p)
                    continue
                ref, new = self._rebind.get(id(p), (None, None))
                if ref is None or ref() is not p:
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that belongs to no "
                        f"model prepared by {self.name!r}. HINT: build the optimizer from "
                        "model.parameters() and pass the model to px.prepare(model, optimizer)."
                    )
                params.append(new)
            group["params"] = params
        prefer_foreach(optimizer)
        return optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard works in place: the user's module is the model

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        # clip_grad_norm_ over DTensor gradients all-reduces the shards' norms: the global norm.
        total = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Gathered on the main process (on CPU); other ranks get {} (no N copies of the model)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class Zero2Strategy(FSDPStrategy):
    name = "zero2"
    reshard_after_forward = False
