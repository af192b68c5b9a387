"""Read a DeepSpeed JSON config and map it onto phalanx's torch-native settings.

    zero_optimization.stage 0/1/2/3      -> strategy ddp / zero1 / zero2 / zero3
    zero_optimization.offload_param / offload_optimizer .device "cpu" (stage 3) -> cpu_offload
    bf16.enabled / fp16.enabled          -> mixed_precision "bf16" / "fp16"
    gradient_accumulation_steps          -> grad_accum_steps
    gradient_clipping                    -> clip before every optimizer.step()
    train_micro_batch_size_per_gpu       -> checked against each prepared DataLoader's batch_size
    train_batch_size                     -> checked: micro batch x accumulation x world_size

Every other key is named in ONE warning: phalanx never ignores a setting silently. A value of
"auto" (as the HF Trainer writes) means "not set here".
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from phalanx.config import names

_STAGES = names.BY_STAGE  # DeepSpeed's ZeRO stage -> the preset of that stage
_TOP_LEVEL = {
    "zero_optimization",
    "bf16",
    "bfloat16",
    "fp16",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
}


@dataclass
class DeepSpeedConfig:
    """What a DeepSpeed config asks for, in phalanx's terms (None: the config does not say)."""

    strategy: str | None = None
    cpu_offload: bool | None = None
    mixed_precision: str | None = None
    grad_accum_steps: int | None = None
    gradient_clipping: float | None = None
    micro_batch_size: int | None = None
    train_batch_size: int | None = None
    unsupported: list[str] = field(default_factory=list)
    source: str = "<dict>"

    def check_world(self, world_size: int) -> None:
        """DeepSpeed's identity: train_batch_size = micro batch x accumulation x world_size."""
        if self.train_batch_size is None or self.micro_batch_size is None:
            return
        accum = self.grad_accum_steps or 1
        if self.micro_batch_size * accum * world_size != self.train_batch_size:
            raise ValueError(
                f"{self.source}: train_batch_size={self.train_batch_size} but "
                f"train_micro_batch_size_per_gpu={self.micro_batch_size} x gradient_accumulation_steps="
                f"{accum} x world_size={world_size} = {self.micro_batch_size * accum * world_size}. "
                "HINT: fix one of them, or drop train_batch_size."
            )

    def check_loader(self, batch_size: int | None) -> None:
        if self.micro_batch_size is not None and batch_size is not None and batch_size != self.micro_batch_size:
            raise ValueError(
                f"{self.source} sets train_micro_batch_size_per_gpu={self.micro_batch_size} but the "
                f"DataLoader has batch_size={batch_size}. HINT: build the DataLoader with "
                f"batch_size={self.micro_batch_size} (px.micro_batch_size), or drop the key."
            )


def _is_set(value: Any) -> bool:
    return value is not None and value != "auto"


def _enabled(section: Any) -> bool | None:
    if not isinstance(section, Mapping):
        return None
    value = section.get("enabled")
    return bool(value) if _is_set(value) else None


def load(config: str | os.PathLike | Mapping[str, Any], warn: bool = True) -> DeepSpeedConfig:
    """Parse a DeepSpeed config (a path to JSON, or the dict itself)."""
    if isinstance(config, Mapping):
        raw, source = dict(config), "DeepSpeed config"
    else:
        path = Path(config)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"DeepSpeed config {str(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {str(path)!r} is not valid JSON: {e}") from None
        source = f"DeepSpeed config {str(path)!r}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source} must be a JSON object, got {type(raw).__name__}")
    out = DeepSpeedConfig(source=source)
    out.unsupported += sorted(k for k in raw if k not in _TOP_LEVEL)
    _read_zero(raw.get("zero_optimization"), out)
    _read_precision(raw, out)
    for key, attr, kind in (
        ("gradient_accumulation_steps", "grad_accum_steps", int),
        ("gradient_clipping", "gradient_clipping", float),
        ("train_micro_batch_size_per_gpu", "micro_batch_size", int),
        ("train_batch_size", "train_batch_size", int),
    ):
        if _is_set(raw.get(key)):
            setattr(out, attr, kind(raw[key]))
    if out.gradient_clipping is not None and out.gradient_clipping <= 0:
        out.gradient_clipping = None  # DeepSpeed's 0.0 means "no clipping"
    if warn and out.unsupported:
        warnings.warn(
            f"phalanx: {source}: these keys have no phalanx equivalent and are NOT applied: "
            f"{', '.join(out.unsupported)}",
            stacklevel=2,
        )
    return out


def _read_zero(zero: Any, out: DeepSpeedConfig) -> None:
    if zero is None:
        out.strategy = _STAGES[0]  # DeepSpeed's default is stage 0: plain data parallelism
        return
    if not isinstance(zero, Mapping):
        raise ValueError(f"{out.source}: zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if stage not in _STAGES:
        raise ValueError(f"{out.source}: zero_optimization.stage={stage!r}; valid stages: 0, 1, 2, 3")
    out.strategy = _STAGES[stage]
    for key in sorted(zero):
        if key == "stage":
            continue
        if key not in ("offload_param", "offload_optimizer"):
            out.unsupported.append(f"zero_optimization.{key}")
            continue
        section = zero[key] if isinstance(zero[key], Mapping) else {}
        device = section.get("device", "none")
        out.unsupported += [f"zero_optimization.{key}.{k}" for k in sorted(section) if k != "device"]
        if device in (None, "none"):
            continue
        if device != "cpu" or stage != 3:
            why = f"device {device!r}" if device != "cpu" else f"stage {stage} (phalanx offloads under stage 3 only)"
            out.unsupported.append(f"zero_optimization.{key} ({why})")
            continue
        # FSDP2 offloads parameters, gradients and optimizer state together.
        out.cpu_offload = True


def _read_precision(raw: Mapping[str, Any], out: DeepSpeedConfig) -> None:
    bf16 = _enabled(raw.get("bf16", raw.get("bfloat16")))
    fp16 = _enabled(raw.get("fp16"))
    if bf16 and fp16:
        raise ValueError(f"{out.source} enables both bf16 and fp16. HINT: enable one of them.")
    if bf16 or fp16:
        out.mixed_precision = "bf16" if bf16 else "fp16"
    elif bf16 is False or fp16 is False:
        out.mixed_precision = "no"
    for name in ("bf16", "bfloat16", "fp16"):
        section = raw.get(name)
        if isinstance(section, Mapping):
            out.unsupported += [f"{name}.{k}" for k in sorted(section) if k != "enabled"]
