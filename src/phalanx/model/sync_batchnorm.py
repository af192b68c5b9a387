"""`sync_batchnorm`: BatchNorm statistics over every rank's samples, as one process on the global batch.

`prepare` converts BatchNorm layers with torch's `SyncBatchNorm.convert_sync_batchnorm`. On GPUs
torch's SyncBatchNorm runs as it is. On CPU torch refuses it (its forward raises "SyncBatchNorm
expected input tensor to be on GPU", and the kernels it calls, `batch_norm_stats` and friends, have
no CPU implementation in torch 2.13; DDP refuses any SyncBatchNorm in a CPU module), so there the
converted layers become `CPUSyncBatchNorm` below: the same attributes and state dict, a BatchNorm
that is not torch's SyncBatchNorm class, whose training forward computes the statistics with torch's
differentiable all-reduce (`torch.distributed.nn.functional.all_reduce`): one for the per-channel
sum and count, one for the squared deviations from the global mean (exact, no E[x²] - E[x]²
cancellation). Autograd's backward of those all-reduces sums every rank's contribution to the
statistics' gradients, which is what torch's CUDA kernel computes by hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_ACCELERATED = ("cuda", "hpu", "xpu")  # where torch's own SyncBatchNorm forward runs


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A converted SyncBatchNorm whose statistics are all-reduced over CPU tensors (gloo)."""

    process_group = None  # set per instance by the conversion (None: the whole world)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean, running_var = (self.running_mean, self.running_var) if track else (None, None)
        group = self.process_group or dist.group.WORLD
        if not (
            use_batch_stats
            and self.training
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(group) > 1
        ):
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, momentum, self.eps
            )
        return self._synced(input, running_mean, running_var, momentum, group)

    def _synced(
        self,
        x: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        group: object,
    ) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        stats = x.float()
        local = torch.cat([stats.sum(dims), stats.new_tensor([x.numel() / max(x.shape[1], 1)])])
        summed = all_reduce(local, group=group)
        count = summed[-1]
        if count.item() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel over all ranks, got {count.item():g}"
            )
        mean = summed[:-1] / count
        deviation = stats - mean.reshape(shape)
        var = all_reduce((deviation * deviation).sum(dims), group=group) / count  # biased, as batch norm uses
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
                unbiased = var.detach() * (count / (count - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        out = deviation * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape)
        if self.bias is not None:
            out = out + self.bias.reshape(shape)
        return out.to(x.dtype)


def refuse_under_pipeline(model: nn.Module, pipeline: str) -> None:
    """sync_batchnorm promises statistics over the global batch; a pipeline (`pipeline`, e.g. "pp=2")
    runs each microbatch through the BatchNorm layers on its own, so their statistics would cover one
    microbatch: refused."""
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        raise ValueError(
            f"sync_batchnorm with {pipeline}: a pipeline runs each microbatch through {norms[0]!r} "
            f"({len(norms)} BatchNorm layer(s)) on its own, so their statistics would cover one microbatch, "
            f"not the global batch one process normalizes over. HINT: train a model with BatchNorm under a "
            f"data-parallel layout (ddp, zero1/2/3, hsdp) with sync_batchnorm, or replace BatchNorm with "
            f"GroupNorm or LayerNorm to use pp"
        )


def convert(model: nn.Module, device: torch.device, process_group: object = None) -> nn.Module:
    """BatchNorm layers become SyncBatchNorm (torch's; phalanx's CPU-capable one off accelerators)
    whose statistics are reduced over `process_group`: the data-parallel ranks (None: every rank).
    Not the world under tp or pp: tensor-parallel ranks see the same samples (each would be counted
    tp times), and a pipeline stage's layers run on its own ranks only (the others never join)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    if device.type not in _ACCELERATED:
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = CPUSyncBatchNorm  # same attributes and state dict; a forward that runs on CPU
    return model


def unsynced_batchnorms(model: nn.Module) -> list[str]:
    """BatchNorm layers whose statistics stay per rank (not SyncBatchNorm), as "name (Class)"."""
    return [
        f"{name or '(the model)'} ({type(module).__name__})"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        and not isinstance(module, (nn.SyncBatchNorm, CPUSyncBatchNorm))
    ]
