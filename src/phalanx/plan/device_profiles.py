"""Device profiles for the step-time model (plan/step_time.py), as data: what one rank computes per
second, and what each link moves. Pure Python; the measurement of this machine (`measure`) imports
torch when called.

A profile's fields, all per rank (one GPU, or one CPU process):
- peak_flops: dense matmul FLOP/s at the training precision (bf16 on GPUs, fp32 on CPUs), and
  dtype_bytes, that precision's bytes per element (what gradients and activations move in);
- matmul_efficiency: the fraction of the peak a transformer's layers reach (their matmuls' shapes and
  the kernels between them; not the job's communication or bubble);
- intra_bandwidth / inter_bandwidth: bytes/s one rank sends within a node (NVLink) and across
  nodes (its InfiniBand NIC), the "bus bandwidth" the ring formulas divide by;
- intra_latency / inter_latency: seconds each collective call costs beyond its bytes;
- ranks_per_node: ranks that share the fast link (a group within it uses intra_*);
- memory_bandwidth: bytes/s one rank reads and writes its memory at, for the optimizer step (0: the
  step is not counted);
- overlap: the fraction of the backward (zero3: forward and backward) under which data-parallel
  traffic can hide; tensor-parallel, context-parallel, pipeline and expert traffic is counted exposed.

A user's own profile is a JSON object with these fields (`phalanx plan --device-profile FILE`);
`phalanx plan --measure-profile FILE` writes one for this machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable


# One achievable fraction of the peak for every GPU profile (not fitted per row or per GPU): large
# bf16 GEMMs reach 70-80 % of H100's dense peak in cuBLAS, and a transformer layer's matmuls, with
# their smaller shapes and the kernels between them (norms, rotary, softmax), about 60 %.
GPU_MATMUL_EFFICIENCY = 0.6
GPU_OVERLAP = 0.9  # FSDP2/DDP buckets: all but the last bucket's traffic hides under the backward
NVLINK_LATENCY = 10e-6  # seconds per collective call within a node, NCCL's ring on NVLink
IB_LATENCY = 30e-6  # across nodes


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float
    matmul_efficiency: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    ranks_per_node: int
    overlap: float
    dtype_bytes: int = 2
    memory_bandwidth: float = 0.0
    source: str = ""

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def _gpu(name: str, nvlink_gbs: float, nic_gbits: float, memory_tbs: float, source: str) -> DeviceProfile:
    # imported here: `phalanx plan`'s flags are built by the launcher's CLI, which never imports the runtime
    from phalanx.runtime.device_peaks import peak_flops

    return DeviceProfile(
        name=name,
        peak_flops=peak_flops(name, "bf16"),  # runtime/device_peaks.py: the data sheets' dense bf16
        matmul_efficiency=GPU_MATMUL_EFFICIENCY,
        intra_bandwidth=nvlink_gbs * 1e9 / 2,  # the data sheet's NVLink figure counts both directions
        inter_bandwidth=nic_gbits * 1e9 / 8,  # one NIC per GPU
        intra_latency=NVLINK_LATENCY,
        inter_latency=IB_LATENCY,
        ranks_per_node=8,
        overlap=GPU_OVERLAP,
        memory_bandwidth=memory_tbs * 1e12,
        source=source,
    )


# From the vendors' data sheets: NVIDIA H100 Tensor Core GPU (SXM5: 989.4 TFLOP/s dense bf16, NVLink 4
# 900 GB/s, HBM3 3.35 TB/s), H200 (SXM: same compute, NVLink 900 GB/s, HBM3e 4.8 TB/s), A100 (SXM4
# 80GB: 312 TFLOP/s bf16, NVLink 3 600 GB/s, HBM2e 2,039 GB/s); DGX H100/H200 nodes: 8 GPUs and 8 ConnectX-7 NDR 400 Gb/s NICs, DGX A100: 8 GPUs and 8
# ConnectX-6 HDR 200 Gb/s NICs.
BUILT_IN: dict[str, Callable[[], DeviceProfile]] = {  # each made when asked for
    "h100": lambda: _gpu("H100 SXM", 900, 400, 3.35, "NVIDIA H100 data sheet; DGX H100: 8 GPUs, 8x NDR 400 Gb/s"),
    "h200": lambda: _gpu("H200 SXM", 900, 400, 4.8, "NVIDIA H200 data sheet; DGX H200: 8 GPUs, 8x NDR 400 Gb/s"),
    "a100": lambda: _gpu("A100 SXM", 600, 200, 2.039, "NVIDIA A100 data sheet; DGX A100: 8 GPUs, 8x HDR 200 Gb/s"),
    # This kind of machine (2 cores, torch 2.13 CPU, gloo), measured by plan/calibrate.py with 2 ranks on
    # 2026-11-29 while 4-5 other jobs ran (load average 5): each rank's fp32 512x512 matmul rate while
    # the other computes too, the fraction of it a transformer block's forward and backward reach, an
    # add over 32 MiB tensors, a 2-rank gloo all-reduce of 4 MiB and of one element. Between moments
    # of a loaded machine these figures differ by 2x or more: measure yours (--measure-profile).
    "cpu": lambda: DeviceProfile(
        name="cpu",
        peak_flops=41.1e9,
        matmul_efficiency=0.85,
        intra_bandwidth=953e6,
        inter_bandwidth=953e6,
        intra_latency=576e-6,
        inter_latency=576e-6,
        ranks_per_node=2,
        overlap=0.0,
        dtype_bytes=4,
        memory_bandwidth=3.64e9,
        source="measured on this machine (phalanx plan --measure-profile), 2 ranks",
    ),
}


def load(name_or_file: str) -> DeviceProfile:
    """A built-in profile by name (h100, h200, a100, cpu), or a JSON file with DeviceProfile's fields;
    ValueError with the fix."""
    key = name_or_file.lower().replace(" ", "").replace("-sxm", "")
    if key in BUILT_IN:
        return BUILT_IN[key]()
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(
            f"--device-profile {name_or_file!r} is neither a built-in profile nor a file. HINT: one of "
            f"{', '.join(BUILT_IN)}, or a JSON file written by `phalanx plan --measure-profile FILE`"
        )
    try:
        data = json.loads(path.read_text())
        wanted = {f.name for f in fields(DeviceProfile)}
        missing = sorted(wanted - set(data) - {"source", "dtype_bytes", "memory_bandwidth"})
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        return DeviceProfile(**{k: v for k, v in data.items() if k in wanted})
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"device profile {name_or_file!r} is not a profile ({error}). HINT: a JSON object with the fields "
            f"{', '.join(f.name for f in fields(DeviceProfile))}, as `phalanx plan --measure-profile FILE` writes"
        ) from None
