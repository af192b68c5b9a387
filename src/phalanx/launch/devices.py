"""How many workers to start, on which GPUs, with how many CPU threads each.

Pure functions over explicit inputs (core count, environment, a GPU counter) so they can be unit
tested without devices. GPUs are counted lazily through torch's NVML-based `device_count`, which
does not initialise CUDA: the launcher must never do that, since forked workers could not use it.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from phalanx import envvars
from phalanx.launch.spec import LaunchError

CPU_DEFAULT_NPROC = 2
"""Workers for `--nproc-per-node auto` without GPUs: enough to exercise the distributed code
path; more rarely helps on CPU, where each worker's intra-op threads already use the cores."""


def count_cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cpusets), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def count_visible_gpus() -> int:
    """CUDA devices visible under the current CUDA_VISIBLE_DEVICES, without initialising CUDA."""
    import torch  # lazy: only when a GPU count is actually needed

    return torch.cuda.device_count()


def cpu_nproc(num_cores: int) -> int:
    """`auto` on a CPU-only machine: CPU_DEFAULT_NPROC, capped by the cores available."""
    return max(1, min(CPU_DEFAULT_NPROC, num_cores))


def omp_threads_per_worker(num_cores: int, nproc_per_node: int) -> int:
    """An equal share of the cores per worker, at least 1, so workers do not oversubscribe."""
    return max(1, num_cores // nproc_per_node)


def cuda_visible_devices_for(gpus: tuple[int, ...], env: Mapping[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES for `--gpus`; refuses a conflicting value already in the environment."""
    wanted = ",".join(str(index) for index in gpus)
    existing = env.get(envvars.CUDA_VISIBLE_DEVICES)
    if existing is not None and existing.replace(" ", "") != wanted:
        raise LaunchError(
            f"--gpus {wanted} conflicts with {envvars.CUDA_VISIBLE_DEVICES}={existing!r} "
            "already set in the environment. HINT: unset "
            f"{envvars.CUDA_VISIBLE_DEVICES} (--gpus sets it), or drop --gpus."
        )
    return wanted


def check_gpu_indices(gpus: tuple[int, ...], num_gpus: int) -> None:
    """Every `--gpus` index must name an existing device."""
    missing = [index for index in gpus if index >= num_gpus]
    if missing:
        available = f"0..{num_gpus - 1}" if num_gpus else "none"
        raise LaunchError(
            f"--gpus names GPU {','.join(map(str, missing))}, but this machine has {num_gpus} "
            f"visible GPU(s) (indices: {available}). HINT: check nvidia-smi, or drop --gpus."
        )


def resolve_nproc(
    nproc_per_node: int | None,
    gpus: tuple[int, ...] | None,
    count_gpus: Callable[[], int],
    num_cores: int,
    kind: str = "auto",
) -> int:
    """The worker count: explicit, else one per `--gpus` entry, else by `kind`.

    kind (torchrun's `--nproc-per-node` words): "auto" = visible GPUs, else the CPU default;
    "gpu" = visible GPUs (none is an error); "cpu" = one per core.
    """
    if nproc_per_node is not None:
        return nproc_per_node
    if gpus is not None:
        return len(gpus)
    if kind == "cpu":
        return num_cores
    if kind == "gpu":
        found = count_gpus()
        if not found:
            raise LaunchError(
                "--nproc-per-node gpu: no GPU is visible here. HINT: use --nproc-per-node N or cpu "
                "to run on CPU, or check nvidia-smi and CUDA_VISIBLE_DEVICES."
            )
        return found
    return count_gpus() or cpu_nproc(num_cores)


def oversubscription_warning(nproc_per_node: int, num_cores: int, num_gpus: int, omp_threads: str | None) -> str | None:
    """One warning when workers outnumber the GPUs in use, or the cores on a CPU run; else None."""
    threads = f"OMP_NUM_THREADS={omp_threads} per worker" if omp_threads else "OMP_NUM_THREADS unset"
    if num_gpus and nproc_per_node > num_gpus:
        return (
            f"phalanx: warning: {nproc_per_node} workers share {num_gpus} visible GPU(s) on this node "
            f"(oversubscribed: ranks will share devices); {threads}."
        )
    if not num_gpus and nproc_per_node > num_cores:
        return (
            f"phalanx: warning: {nproc_per_node} workers on {num_cores} CPU core(s) "
            f"(oversubscribed: they will compete for cores); {threads}."
        )
    return None


def worker_env_for_devices(
    nproc_per_node: int,
    gpus: tuple[int, ...] | None,
    env: Mapping[str, str],
    num_cores: int,
) -> dict[str, str]:
    """Variables the launcher exports to all workers for devices and threads."""
    exported: dict[str, str] = {}
    if gpus is not None:
        exported[envvars.CUDA_VISIBLE_DEVICES] = cuda_visible_devices_for(gpus, env)
    if envvars.OMP_NUM_THREADS not in env:
        exported[envvars.OMP_NUM_THREADS] = str(omp_threads_per_worker(num_cores, nproc_per_node))
    return exported
