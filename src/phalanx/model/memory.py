"""Model-state memory: the bytes of one parameter as a rank holds it (whole, its dim-0 chunk, its
optimizer state, zero1's gather buffer) and what a real rank holds (the measurement, px.memory_report),
in bytes of parameters, gradients and optimizer state.

The per-rank model laid over a layout, keyed by the parallel plan, is strategies/memory_plan.py:
ddp replicates everything; zero1 keeps full parameters and gradients and splits every parameter's
optimizer state along dim 0 over the ranks (strategies/optimizers/sharded_optimizer.py), with `zero1_gather
persistent` also a gather buffer of the whole model kept between steps (`buffers`); zero2/zero3 split
every parameter along dim 0 into chunks (as FSDP2 does). Activations and transient communication
buffers are not counted here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from phalanx.config import kinds

# Optimizer state tensors per parameter, each the parameter's size, plus a scalar `step` tensor.
OPTIMIZER_STATES: dict[str, tuple[int, bool]] = {
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (0, False),
    "sgd-momentum": (1, False),
    "adagrad": (1, True),
    "rmsprop": (1, True),
}
STEP_BYTES = 4  # AdamW's `step` is a float32 scalar tensor per parameter on CPU
DEFAULT_BUDGET_FRACTION = 0.6  # of device memory; the rest is left for activations and buffers
CPU_RUNTIME_BYTES = 2 * 2**20
"""The anonymous memory (heap) a CPU process holds after its first training steps beyond its model
state, in every layout: torch's and the model code's own caches. Measured in one process without
phalanx (RssAnon after 4 AdamW steps and malloc_trim, less 4x the parameters, transformers Llamas of
8-25 MB, batches of 2 x 64 tokens): 1.9-2.5 MiB. Not counted: the pages of torch's libraries that
the first steps make resident (about 20 MiB, file-backed and reclaimable, and 6-20 MiB more or less
with the page cache's state, so no plan can promise them). On a GPU it is host memory, outside the
device's."""
CUDA_RUNTIME_BYTES = 64 * 2**20
"""What a GPU process's caching allocator holds beyond its model state, in every layout: the cuBLAS
and cuBLASLt workspaces torch allocates at the first matrix product (32 MiB each on Hopper). Measured
on an H200 (torch 2.11, CUDA 13): at rest minus the model state was 64.0 MiB for ddp, zero1, zero2,
zero3 and tp 2 alike (bench/memory.py --fake-world). Other architectures get other sizes, and
CUBLAS_WORKSPACE_CONFIG changes them; NCCL's own buffers are outside the allocator and not counted."""


GRAD_SHAPE_ATTR = "phalanx_grad_shape"
"""Set on a planning (meta) parameter whose gradient a rank holds at another shape than the
parameter: tensor parallel's row-split embedding, whose gradient torch gives whole (Replicate)."""


@dataclass(frozen=True)
class ParamSize:
    name: str
    shape: tuple[int, ...]
    element_size: int
    grad_shape: tuple[int, ...] | None = None
    """The gradient's shape where it differs from the parameter's (GRAD_SHAPE_ATTR)."""

    @property
    def grad_nbytes(self) -> int:
        return self.nbytes if self.grad_shape is None else math.prod(self.grad_shape) * self.element_size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass
class RankBytes:
    """Model-state bytes one rank holds on its device (offloaded bytes are in `host`)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    host: int = 0
    buffers: int = 0
    """Communication buffers phalanx keeps between steps (zero1's persistent gather buffer)."""
    runtime: int = 0
    """What the process holds whatever the layout (CPU_RUNTIME_BYTES on CPU, CUDA_RUNTIME_BYTES on a GPU)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.runtime


def runtime_bytes(device_type: str) -> int:
    """The runtime's own bytes on a device of this type (see CPU_RUNTIME_BYTES, CUDA_RUNTIME_BYTES)."""
    return {"cpu": CPU_RUNTIME_BYTES, "cuda": CUDA_RUNTIME_BYTES}.get(device_type, 0)


def model_sizes(model: nn.Module) -> list[ParamSize]:
    """Trainable parameters' shapes (works on a model built on the meta device)."""
    return [
        ParamSize(n, tuple(p.shape), p.element_size(), getattr(p, GRAD_SHAPE_ATTR, None))
        for n, p in model.named_parameters()
        if p.requires_grad
    ]


def unit_bytes(unit: nn.Module) -> int:
    """Bytes of a unit's trainable parameters, gathered whole (what zero3 holds while it computes)."""
    return sum(p.numel() * p.element_size() for p in unit.parameters() if p.requires_grad)


def _optimizer_bytes(size: ParamSize, numel: int, optimizer: str) -> int:
    try:
        states, has_step = OPTIMIZER_STATES[optimizer]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {optimizer!r} for the memory plan; known: {', '.join(OPTIMIZER_STATES)}"
        ) from None
    return states * numel * size.element_size + (STEP_BYTES if has_step and numel > 0 else 0)


def _dim0_chunk(shape: tuple[int, ...], world_size: int, rank: int) -> int:
    """Elements of rank `rank`'s dim-0 chunk, as torch.chunk splits (FSDP2's sharding)."""
    if not shape:
        return 1 if rank == 0 else 0
    rows = math.ceil(shape[0] / world_size)
    mine = max(0, min(rows, shape[0] - rank * rows))
    return mine * math.prod(shape[1:])


def zero1_optimizer_bytes(size: ParamSize, world_size: int, rank: int, optimizer: str = "adamw") -> int:
    """zero1's optimizer state for one parameter on `rank`: the state of its dim-0 chunk (a scalar
    parameter is stepped whole on every rank); every rank keeps a `step`, even for an empty chunk."""
    numel = size.numel if not size.shape else _dim0_chunk(size.shape, world_size, rank)
    _optimizer_bytes(size, 0, optimizer)  # an unknown optimizer's error
    states, has_step = OPTIMIZER_STATES[optimizer]
    return states * numel * size.element_size + (STEP_BYTES if has_step else 0)


def zero1_gather_buffer_bytes(sizes: list[ParamSize], world_size: int) -> int:
    """zero1_gather persistent: the buffer every rank's padded chunk of every parameter is
    gathered into (in place: this rank's slot is what it sends), kept between steps."""

    def padded_numel(size: ParamSize) -> int:
        return math.ceil(size.shape[0] / world_size) * math.prod(size.shape[1:]) if size.shape else 1

    return sum(padded_numel(s) * s.element_size for s in sizes) * world_size


def sharded_bytes(sizes: list[ParamSize], group_size: int, rank: int, optimizer: str = "adamw") -> RankBytes:
    """Rank `rank`'s dim-0 shards over `group_size` ranks: parameters, gradients and optimizer state."""
    numels = [(s, _dim0_chunk(s.shape, group_size, rank)) for s in sizes]
    shard = sum(n * s.element_size for s, n in numels)
    return RankBytes(shard, shard, sum(_optimizer_bytes(s, n, optimizer) for s, n in numels))


def device_budget_bytes(device: torch.device, local_world_size: int = 1) -> int:
    """Default per-device budget: a fraction of the GPU's memory, or of RAM shared by local ranks."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_world_size, 1)
    return int(total * DEFAULT_BUDGET_FRACTION)


def parse_bytes(text: str) -> int:
    """'8GB', '512MiB', '1e9' -> bytes (binary units); ValueError with a HINT otherwise."""
    try:
        return kinds.parse_bytes(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; HINT: write e.g. 8GB, 512MiB or 1000000") from None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- measuring a real rank ---------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def measure(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, runtime: int = 0) -> RankBytes:
    """Bytes of the parameters, gradients and optimizer state this rank holds (local shards), and
    `runtime` (runtime_bytes of the device) as the process's own."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    out = RankBytes(params=sum(_bytes(p) for p in params), grads=sum(_bytes(g) for g in grads), runtime=runtime)
    if optimizer is not None:
        from phalanx.loop.accumulation import unwrap_optimizer

        optimizer = unwrap_optimizer(optimizer)
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
        out.optimizer = sum(_bytes(t) for t in _tensors(list(inner.state.values())))
        out.buffers = optimizer.buffer_bytes() if hasattr(optimizer, "buffer_bytes") else 0
    return out
