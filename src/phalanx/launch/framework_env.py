"""What `accelerate launch` and `fabric run` would set, for Accelerate, HF Trainer and Lightning
Fabric scripts under `phalanx run`.

Such a script never creates Phalanx(); it reads Accelerate's own variables. Without them, on a
machine with no accelerator, each worker becomes a world of one: Accelerate joins the processes
only on an accelerator unless told `ACCELERATE_USE_CPU` (accelerate/utils/launch.py sets it from
`--cpu`). phalanx knows the device and the layout, so it hands over the same variables:
- ACCELERATE_USE_CPU=true when no GPU is in use;
- ACCELERATE_MIXED_PRECISION from --mixed-precision;
- ACCELERATE_USE_FSDP, FSDP_VERSION=2 and FSDP_RESHARD_AFTER_FORWARD for zero2 / zero3 on GPUs
  (Accelerate runs FSDP on accelerators only: on CPU it keeps DDP, and the launcher says so).
A Fabric script reads `fabric run`'s variables (lightning/fabric/cli.py): without LT_CLI_USED and
LT_DEVICES it runs each worker as a world of one even under torchrun's variables; phalanx hands over
LT_CLI_USED=1, LT_ACCELERATOR (cpu or cuda), LT_DEVICES (processes per node), LT_NUM_NODES (a fixed
node count) and LT_PRECISION from --mixed-precision. No other script reads LT_*.
Fabric's other form, devices in the code and `fabric.launch()` (what `python train.py` and torchrun
run), refuses to launch under LT_CLI_USED: a script whose source calls `.launch(` gets the rest only.
Accelerate's `PartialState()` reads no variable for the CPU (only Accelerator reads
ACCELERATE_USE_CPU): a script that makes one is a world of one per process on CPU, under torchrun
too. `makes_partial_state` tells the worker to make Accelerate's shared state with `cpu=True` first.
A variable already in the environment is the user's and is left alone. Pure: no torch.
"""

from __future__ import annotations

import ast
import os
import sys
from importlib.machinery import PathFinder
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
        wanted.update(
            {
                ACCELERATE_USE_FSDP: "true",
                FSDP_VERSION: "2",
                FSDP_RESHARD_AFTER_FORWARD: _FSDP_RESHARD[settings.config.strategy],
            }
        )
    return {key: value for key, value in wanted.items() if key not in environ}


FABRIC_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}  # phalanx's -> Fabric's


def fabric_env(
    settings: Any,
    nproc_per_node: int,
    fixed_nnodes: int | None,
    num_gpus_in_use: int,
    environ: Mapping[str, str],
    source: str = "",
) -> dict[str, str]:
    """The LT_* variables `fabric run` would set (`fixed_nnodes`: None for an elastic node range,
    which Fabric cannot be told), less LT_CLI_USED for a script that calls `fabric.launch()`
    (`source`: the script's text, `script_source`)."""
    wanted = {
        "LT_ACCELERATOR": "cuda" if num_gpus_in_use else "cpu",
        "LT_DEVICES": str(nproc_per_node),
    }
    if not calls_launch(source):
        wanted["LT_CLI_USED"] = "1"
    if fixed_nnodes is not None:
        wanted["LT_NUM_NODES"] = str(fixed_nnodes)
    if settings is not None and settings.is_set("mixed_precision"):
        wanted["LT_PRECISION"] = FABRIC_PRECISION[str(settings.config.mixed_precision)]
    return {key: value for key, value in wanted.items() if key not in environ}


def reaches_fabric(name: str, value: Any) -> bool:
    """Whether the setting `name` = `value` reaches a Fabric script through `fabric_env` (Fabric's
    own default strategy over several processes is DDP)."""
    return name == "mixed_precision" or (name == "strategy" and value in _DDP)


def reaches_accelerate(name: str, value: Any, num_gpus_in_use: int) -> bool:
    """Whether the setting `name` = `value` reaches an Accelerate script through `accelerate_env`."""
    if name == "mixed_precision":
        return True
    return (
        name == "strategy" and value in _DDP or (name == "strategy" and num_gpus_in_use > 0 and value in _FSDP_RESHARD)
    )


_TRUE = ("1", "true", "yes", "y", "on", "t")  # accelerate.utils.environment.str_to_bool's true words


def calls_launch(source: str) -> bool:
    """Whether the script calls `fabric.launch()` (Fabric's form for `python train.py`), which
    Fabric refuses once LT_CLI_USED says its CLI made the processes."""
    return "launch" in _names_used(source)[0]


def makes_partial_state(source: str, environ: Mapping[str, str]) -> bool:
    """Whether the worker should make Accelerate's shared state with `cpu=True` before the script:
    the script calls or imports PartialState, and the job runs on CPU (ACCELERATE_USE_CPU, which
    phalanx hands over on CPU and Accelerator alone reads) across several processes."""
    on_cpu = environ.get(ACCELERATE_USE_CPU, "").lower() in _TRUE
    if not on_cpu or int(environ.get("WORLD_SIZE", "1")) < 2:
        return False
    called, imported = _names_used(source)
    return "PartialState" in called or "PartialState" in imported


def _names_used(source: str) -> tuple[set[str], set[str]]:
    """The names the script's code calls (`f(...)`, `x.f(...)`: f) and imports (not its comments
    or strings); nothing for a file that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set(), set()
    called, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update(alias.name.split(".")[-1] for alias in node.names)
    return called, imported


def script_source(target: str, is_module: bool) -> str:
    """The text of the file `python TARGET` (or `python -m TARGET`: the module, or a package's
    __main__.py, found without importing anything) runs; '' when there is none to read."""
    path = _module_file(target) if is_module else target
    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return ""


def _module_file(name: str) -> str | None:
    """Where `python -m NAME` finds its code, searching the working directory first as it does."""
    places: list[str] | None = [os.getcwd(), *sys.path]
    spec = None
    for part in [*name.split("."), "__main__"]:
        if places is None:
            return spec.origin if spec is not None else None
        spec = PathFinder.find_spec(part, places)
        if spec is None:
            return None
        places = list(spec.submodule_search_locations or []) or None
    return spec.origin if spec is not None else None
