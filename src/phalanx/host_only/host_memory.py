"""Host memory that goes back to the system when tensors are freed (CPU runs, glibc).

glibc serves a large allocation from its heap once a block of that size has been freed (its mmap
threshold rises with every freed block, up to 32 MiB), and keeps what is freed there: ZeRO's
gathered parameters, reduced gradients and each step's activations stay resident after they are
freed, and malloc_trim cannot give back pages that smaller live blocks share. Measured on a 7.9M
parameter Llama, 2 CPU processes (bench/memory.py): at rest zero3 held 0.89x of ddp's RSS where
its bytes are 0.50x; with a fixed 1 MiB threshold, 0.61x. A fixed threshold maps every tensor of
that size or more on its own and unmaps it when freed, at the cost of a page fault per page when
such a tensor is made again.

That price is paid by every large tensor a step makes, activations included: fixed for every job,
1 MiB cost ddp about 17% of its speed on CPU (474-486 against 562-584 samples/s, a 2.9M-parameter
encoder on 2 processes). So the setting's default, `auto`, fixes the threshold only where a layout
frees whole gathered blocks each step (zero2, zero3, hsdp: parameters sharded), and leaves glibc's
own behaviour to ddp, zero1, dp, single and tensor parallel; an explicit size wins either way.

Host-only (phalanx/host_only/): `fix_for` engages on gloo only (tensors in host memory); a CUDA job's
tensors live in the caching allocator, and glibc is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from phalanx.host_only import engages

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
GATHERED_BLOCKS_THRESHOLD = 2**20  # auto's threshold where a step gathers and frees blocks


def threshold_for(setting: int | str, frees_gathered_blocks: bool) -> int:
    """The threshold `host_mmap_threshold` asks of a layout: an explicit size as given; `auto`:
    1 MiB where a step gathers and frees whole blocks (zero2, zero3, hsdp), else 0 (glibc's dynamic
    threshold: no page faults for tensors made again)."""
    if setting != "auto":
        return int(setting)
    return GATHERED_BLOCKS_THRESHOLD if frees_gathered_blocks else 0


def fix_mmap_threshold(threshold: int) -> bool:
    """Map host allocations of `threshold` bytes or more on their own (0: leave glibc's dynamic
    threshold; the setting's kind keeps it within glibc's 32 MiB). False where the C library has no
    mallopt (musl, macOS) or refuses the value."""
    if threshold <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)) == 1


def fix_for(backend: str, setting: int | str, frees_gathered_blocks: bool) -> bool:
    """The threshold `host_mmap_threshold` asks of a layout, fixed when the job's tensors live in host
    memory (`backend` gloo); False, touching nothing, on any other backend."""
    if not engages(backend):
        return False
    return fix_mmap_threshold(threshold_for(setting, frees_gathered_blocks))
