"""Host-only workarounds: code that exists because this job's tensors live in host memory and its
collectives run on gloo (CPU runs), and that never engages on NCCL/CUDA.

Every piece here was measured on CPU ranks and works around gloo's or glibc's costs, not a flaw of
the layout itself; a GPU job (CUDA device, NCCL backend, the pair `runtime/context.py` chooses by
device) runs torch's own code instead. Each module asks `engages(backend)` (the backend of the process
group, or the one the device chooses) before doing anything, and `tests/unit/test_host_only.py`
asks each one with the backend a CUDA device gets, nccl, on CPU:

- `gloo_comms.py`: FSDP2's reduce-scatter and all-gather replaced, on gloo, by an all-to-all and
  each rank's chunk sent point to point into its place (gloo's own cost twice the bytes moved, and
  a collective costs a thread handoff a send does not); zero1's gather too;
- `step_buffers.py`: those collectives' buffers handed from one unit to the next within a step
  (fresh host pages are faulted in and zeroed for every unit otherwise); used by gloo_comms only;
- `host_memory.py`: glibc's mmap threshold fixed where a step frees whole gathered blocks, so host
  memory goes back to the system;
- `polite_writes.py`: the async checkpoint writer steps aside while the training loop's threads
  wait for a CPU (the loop and the writer share the host's cores only when the loop runs on them);
- PowerSGD's one bucket at a time on gloo (strategies/ddp_options.py asks `engages`): torch's hook
  blocks gloo's two worker threads with two buckets in flight.

Not here: data/worker_start.py guards DataLoader workers against CPython < 3.11.10's fork deadlock,
which NCCL's watchdog thread can trigger as gloo's work loop does: a Python-version workaround, not
a host-only one. Pure Python at import (no torch): the decision is asked before anything runs.
"""

from __future__ import annotations

HOST_BACKEND = "gloo"
"""The backend a CPU device chooses (runtime/context.py): the only one host-only code engages on."""


def engages(backend: str) -> bool:
    """Whether host-only code runs for a job whose process group (or device's choice) is `backend`:
    gloo only; never nccl, nor a mixed "cpu:gloo,cuda:nccl" group (a CUDA job)."""
    return backend == HOST_BACKEND
