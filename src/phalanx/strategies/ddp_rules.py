"""Which settings only DDP understands, and the check that refuses them under strategies without
DDP. Pure Python, no torch: `phalanx run` runs it before any worker starts, `Phalanx()` before it
joins the process group."""
from __future__ import annotations

from typing import Any, Mapping

# The settings that are DistributedDataParallel options or its comm hook (rows of the schema).
DDP_SETTINGS: tuple[str, ...] = ("find_unused_parameters", "static_graph", "bucket_cap_mb", "gradient_as_bucket_view",
                                 "comm_hook", "powersgd_rank", "powersgd_start_iter")
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
# Strategies with no DistributedDataParallel inside (FSDP2 reduces its own gradients, DataParallel
# runs one process): DDP's options would be silently ignored there.
WITHOUT_DDP = {"zero2": "FSDP2", "zero3": "FSDP2", "fsdp": "FSDP2", "dp": "DataParallel"}
WITH_DDP = "ddp or zero1"


def _meaningful(name: str, value: Any) -> bool:
    """Whether a value asks DDP for something (comm_hook none / find_unused false ask nothing)."""
    if value is None:
        return False
    text = str(value).strip().lower()
    if name == "comm_hook":
        return text not in ("", "none")
    if name in ("find_unused_parameters", "static_graph"):
        return text not in ("", "0", "false", "no", "off")
    return text != ""


def refuse_without_ddp(strategy: str | None, values: Mapping[str, Any], source: str = "") -> None:
    """ValueError if `values` (setting name -> value) ask DDP for something under a strategy without DDP."""
    name = (strategy or "").strip().lower()
    if name not in WITHOUT_DDP:
        return
    asked = [f"{k}={values[k]!r}" for k in DDP_SETTINGS if _meaningful(k, values.get(k))]
    if asked:
        raise ValueError(
            f"{', '.join(asked)}{source}: DistributedDataParallel options, but strategy {strategy!r} uses "
            f"{WITHOUT_DDP[name]}, which has no DDP. HINT: use strategy {WITH_DDP} for them, or "
            f"drop them (zero2/zero3 need no find_unused_parameters: FSDP2 handles unused parameters)"
        )
