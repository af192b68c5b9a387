"""Peak dense matmul throughput of known GPUs, for MFU. From the vendors' data sheets (dense, i.e.
without 2:4 sparsity), in TFLOP/s. A device or precision not listed has no peak: no MFU, not a guess.
"""

from __future__ import annotations

import re

# (name pattern, {precision: TFLOP/s}), most specific first; "tf32" is fp32 matmuls run as TF32.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    (r"\bH200\b.*\bNVL\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL40S\b", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bV100\b", {"fp16": 125.0, "fp32": 15.7}),  # SXM2; no bf16 units
)


def peak_flops(device_name: str, precision: str) -> float | None:
    """FLOP/s of one device at `precision` (bf16, fp16, tf32 or fp32), None when not known."""
    for pattern, peaks in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            value = peaks.get(precision)
            return None if value is None else value * 1e12
    return None


def matmul_precision(mixed_precision: str, tf32: bool) -> str:
    """The precision the model's matmuls run at: the mixed precision, else fp32 (tf32 when allowed)."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return "tf32" if tf32 else "fp32"


def device_peak(device: object, mixed_precision: str) -> float | None:
    """The peak of this process's device (None on CPUs and unknown GPUs)."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"  # "high"/"medium": TF32 (allow_tf32 sets it too)
    return peak_flops(torch.cuda.get_device_name(device), matmul_precision(mixed_precision, tf32))
