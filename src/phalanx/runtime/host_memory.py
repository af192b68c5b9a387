"""Host memory that goes back to the system when tensors are freed (CPU runs, glibc).

glibc serves a large allocation from its heap once a block of that size has been freed (its mmap
threshold rises with every freed block, up to 32 MiB), and keeps what is freed there: ZeRO's
gathered parameters, reduced gradients and each step's activations stay resident after they are
freed, and malloc_trim cannot give back pages that smaller live blocks share. Measured on a 7.9M
parameter Llama, 2 CPU processes (bench/memory.py): at rest zero3 held 0.89x of ddp's RSS where
its bytes are 0.50x; with a fixed 1 MiB threshold, 0.61x. A fixed threshold maps every tensor of
that size or more on its own and unmaps it when freed, at the cost of a page fault per page when
such a tensor is made again.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


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
