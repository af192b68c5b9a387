"""Communication buffers a training step reuses instead of allocating afresh for every unit.

FSDP2 allocates each unit's all-gather output and reduce-scatter buffers per use. On CPU, with
`host_mmap_threshold` giving freed blocks back to the system, each of those is fresh pages that the
kernel faults in and zeroes, for every unit's gathers and reductions. A unit's buffers are the size
of the next identical unit's (a transformer's blocks), so a step can hand a freed one on: on the
small-vocab encoder (bench/strategies.py, 2 CPU ranks) a zero3 step took 160.2 instead of 171.9 ms
of CPU (median of 8 alternating rounds; 160.9 / 172.4 in 10 more), the parameters after it bit-equal.

What is kept is bounded: besides the buffer handed out last, at most `keep` (default 1) that
nothing uses, the least recently used dropped first, and all of them are dropped when the model's
forward ends (a forward hook on the root) and when the backward pass ends (an autograd final
callback, as FSDP2 queues its own): memory between steps and the optimizer's step hold none of them.
The kept one moved a step's peak by 0-4 MiB on bench/memory.py's Llama (zero2 0.83-0.87 of ddp's,
zero3 0.77-0.80, where they read 0.82 and 0.77 before); keeping 2 took zero2's to 0.92.

Host-only (phalanx/host_only/): made only by gloo_comms' collectives, which engage on gloo only; on
NCCL no StepBuffers exists (CUDA's caching allocator already reuses freed blocks).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; absent: nothing is reused


def _unused(buffer: torch.Tensor) -> bool:
    """Nothing but this pool refers to the buffer's memory (the count includes the pool's tensor and
    the storage object made to ask)."""
    return _use_count(buffer.untyped_storage()._cdata) <= 2


class StepBuffers:
    """A small pool of flat buffers, reused by exact size and dtype within one step."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._buffers: list[torch.Tensor] = []  # least recently handed out first
        self._release_queued = False
        self.fresh = self.reused = 0  # buffers allocated and handed on so far (diagnostics, tests)

    def take(self, size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `size`: an unused kept buffer of its size when there is one."""
        if _use_count is None:
            return torch.empty(*size, dtype=dtype, device=device)
        self._release_when_backward_ends()
        numel = math.prod(size)
        self._drop_unused(self.keep)
        for i, buffer in enumerate(self._buffers):
            if buffer.numel() == numel and buffer.dtype == dtype and buffer.device == device and _unused(buffer):
                self._buffers.append(self._buffers.pop(i))
                self.reused += 1
                break
        else:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers.append(buffer)
            self.fresh += 1
        return buffer.view(*size)

    def release(self) -> None:
        """Drop every kept buffer (those still in use live on with their users)."""
        self._buffers.clear()
        self._release_queued = False

    def release_after_forward(self, root: torch.nn.Module) -> None:
        """Drop the buffers when each forward of `root` (the model as the user calls it) ends."""
        root.register_forward_hook(lambda *_: self.release(), always_call=True)

    def __len__(self) -> int:
        return len(self._buffers)

    def _drop_unused(self, limit: int) -> None:
        unused = [i for i, buffer in enumerate(self._buffers) if _unused(buffer)]
        for i in reversed(unused[: max(0, len(unused) - limit)]):
            del self._buffers[i]

    def _release_when_backward_ends(self) -> None:
        """Queue `release` for the end of the running backward pass, if one is running."""
        if self._release_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.release)
        except RuntimeError:  # "Final callbacks can only be installed during backward pass."
            return
        self._release_queued = True
