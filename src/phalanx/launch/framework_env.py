"""What `accelerate launch` would set, for Accelerate and HF Trainer scripts under `phalanx run`.

Such a script never creates Phalanx(); it reads Accelerate's own variables. Without them, on a
machine with no accelerator, each worker becomes a world of one: Accelerate joins the processes
only on an accelerator unless told `ACCELERATE_USE_CPU` (accelerate/utils/launch.py sets it from
`--cpu`). phalanx knows the device and the layout, so it hands over the same variables:
- ACCELERATE_USE_CPU=true when no GPU is in use;
- ACCELERATE_MIXED_PRECISION from --mixed-precision;
- ACCELERATE_USE_FSDP, FSDP_VERSION=2 and FSDP_RESHARD_AFTER_FORWARD for zero2 / zero3 on GPUs
  (Accelerate runs FSDP on accelerators only: on CPU it keeps DDP, and the launcher says so).
A variable already in the environment is the user's and is left alone. Pure: no torch.
"""
from __future__ import annotations

from typing import Any, Mapping

from phalanx.config import names

ACCELERATE_USE_CPU = "ACCELERATE_USE_CPU"
ACCELERATE_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"
ACCELERATE_USE_FSDP = "ACCELERATE_USE_FSDP"
FSDP_VERSION = "FSDP_VERSION"
FSDP_RESHARD_AFTER_FORWARD = "FSDP_RESHARD_AFTER_FORWARD"
# phalanx's sharded presets Accelerate's FSDP2 expresses: reshard after forward (zero3) or not (zero2)
_FSDP_RESHARD = {name: "true" if stage >= 3 else "false" for stage, name in names.BY_STAGE.items() if stage >= 2}
_FSDP_RESHARD.update({alias: _FSDP_RESHARD[to] for alias, to in names.STRATEGY_ALIASES.items() if to in _FSDP_RESHARD})
_DDP = (names.BY_STAGE[0], names.AUTO)  # Accelerate's default, multi-GPU data parallel


def accelerate_env(settings: Any, num_gpus_in_use: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the workers' environment (`settings`: config.Resolved, or None)."""
    wanted: dict[str, str] = {}
    if num_gpus_in_use == 0:
        wanted[ACCELERATE_USE_CPU] = "true"
    if settings is not None and settings.is_set("mixed_precision"):
        wanted[ACCELERATE_MIXED_PRECISION] = str(settings.config.mixed_precision)
    if settings is not None and num_gpus_in_use > 0 and settings.config.strategy in _FSDP_RESHARD:
        wanted.update({ACCELERATE_USE_FSDP: "true", FSDP_VERSION: "2",
                       FSDP_RESHARD_AFTER_FORWARD: _FSDP_RESHARD[settings.config.strategy]})
    return {key: value for key, value in wanted.items() if key not in environ}


def reaches_accelerate(name: str, value: Any, num_gpus_in_use: int) -> bool:
    """Whether the setting `name` = `value` reaches an Accelerate script through `accelerate_env`."""
    if name == "mixed_precision":
        return True
    return name == "strategy" and value in _DDP or (name == "strategy" and num_gpus_in_use > 0
                                                              and value in _FSDP_RESHARD)
