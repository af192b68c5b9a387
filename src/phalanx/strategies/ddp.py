"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets (ddp, and
zero1 under its sharded-state optimizer)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.strategies.ddp_options import register_comm_hook
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.optimizers import zero1_grads


class PreparedDDP(DistributedDataParallel):
    """torch's DDP that answers the wrapped module's own attributes: `model.generate(...)`,
    `model.config`, `model.save_pretrained(...)` work on the prepared model as they do on the
    user's module and as they do under every layout that lays the module out in place (zero2,
    zero3, tp). DDP's own attributes win; only a name DDP lacks is looked up on `.module`.
    A method found there runs the module directly: outside DDP's forward, so it syncs no
    gradients (what `generate` under `torch.no_grad()` wants; train through `model(...)`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("__"):
                raise
            return getattr(inner, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """`copy.deepcopy(model)` (torch's AveragedModel for EMA/SWA) copies the wrapped module: a copy
        syncs no gradients, and torch's DDP pickles only over the default process group, which a
        data-parallel group beside pp, tp or cp is not ("DDP Pickling/Unpickling are only supported...")."""
        return copy.deepcopy(self.module, memo)

    def _match_all_reduce_for_bwd_pass(self) -> None:
        """A rank out of data under torch's Join shadows its peers' gradient all-reduces with zeros;
        torch drops the results, here they become its gradients: zero1's joined rank steps its
        chunk of every parameter with them (else its chunk would stop being stepped)."""
        buckets = self.reducer._get_zeros_like_grad_buckets()
        works = [self.reducer._run_comm_hook(bucket) for bucket in buckets]
        with torch.no_grad():
            for bucket, work in zip(buckets, works):
                reduced = work.wait()
                flat = (reduced[0] if isinstance(reduced, (list, tuple)) else reduced).reshape(-1)
                offset = 0
                for param in bucket.parameters():  # laid out in the bucket in this order, dense
                    part = flat[offset : offset + param.numel()].view_as(param)
                    offset += param.numel()
                    if param.grad is None:
                        param.grad = part.clone()
                    else:
                        param.grad.copy_(part)


def apply(
    model: nn.Module,
    options: StrategyOptions,
    device: torch.device,
    group: Any = None,
    find_unused_parameters: bool | None = None,
    scatter_grads: bool = False,
) -> nn.Module:
    """`model` (on `device`) wrapped in DDP over `group` (None: every rank), with the comm hook
    the settings ask for; its state is kept on the wrapper for checkpoints. `find_unused_parameters`:
    what the layout requires whatever the settings say (a pipeline stage: True). `scatter_grads`
    (zero1): without a compression hook, gradients are reduce-scattered to their chunks' owners, as
    the zero1_grads setting asks (strategies/optimizers/zero1_grads.py, kept on the wrapper as `phalanx_zero1_grads`)."""
    device_ids = [device.index] if device.type == "cuda" else None
    # find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view (default on:
    # gradients live in the communication buckets, one copy fewer per step); ddp_kwargs win.
    kwargs = {**options.ddp.ddp_kwargs(), **options.extra.get("ddp_kwargs", {})}
    if find_unused_parameters is not None:
        kwargs["find_unused_parameters"] = find_unused_parameters
    wrapped = PreparedDDP(model, device_ids=device_ids, process_group=group, **kwargs)
    if scatter_grads and options.ddp.comm_hook == "none":
        grads = zero1_grads.Zero1Grads(group)
        wrapped.register_comm_hook(None, grads.hook)
        wrapped.phalanx_zero1_grads = grads
        wrapped.phalanx_comm_hook_state = None
        return wrapped
    wrapped.phalanx_comm_hook_state = register_comm_hook(wrapped, options.ddp)
    return wrapped
