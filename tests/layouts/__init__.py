"""THE list of layouts phalanx is tested and documented with: the composition matrix
(tests/dist/test_compatibility.py, docs/compatibility.md), the family sweep (tests/dist/test_families.py,
docs/models.md) and the optimizer table (docs/optimizers.md) each take their columns from it, by name.

It lives with the tests, outside the runtime packages: phalanx itself never needs a list of layouts
(a layout is a ParallelPlan the presets build from the settings). Each generator keeps its docs page's
entry point: `python -m tests.layouts.compatibility docs/compatibility.md`, `python -m
tests.layouts.families docs/models.md`, `python -m tests.layouts.optimizers docs/optimizers.md`
(no path: print it); tests/docs/ fails when a committed page differs from what they write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.strategies.plan import presets
from phalanx.strategies.plan.parallel_plan import MESH_DIMS, ParallelPlan


@dataclass(frozen=True)
class Layout:
    name: str
    settings: dict[str, Any]
    """Phalanx settings, as a user writes them (a strategy setting's value, its degrees)."""
    processes: int
    local: int | None = None
    """processes per node, where the layout follows the nodes (hsdp's replicas); None: all on one."""
    cpu_offload: bool = False

    def plan(self) -> ParallelPlan:
        """The ParallelPlan the presets build for these settings on `processes` processes."""
        degrees = {dim: self.settings[dim] for dim in MESH_DIMS if dim in self.settings}
        return presets.build(
            self.settings["strategy"],
            presets.asking(**degrees),
            world_size=self.processes,
            local_world_size=self.local or self.processes,
            cpu_offload=self.cpu_offload,
        )


LAYOUTS: tuple[Layout, ...] = (
    Layout("ddp", {"strategy": "ddp"}, 2),
    Layout("zero1", {"strategy": "zero1"}, 2),
    Layout("zero2", {"strategy": "zero2"}, 2),
    Layout("zero3", {"strategy": "zero3"}, 2),
    Layout("hsdp 2 x 2", {"strategy": "hsdp"}, 4, local=2),
    Layout("tp 2", {"strategy": "ddp", "tp": 2}, 2),
    Layout("zero3 x tp 2", {"strategy": "zero3", "tp": 2}, 4),
    Layout("pp 2", {"strategy": "ddp", "pp": 2, "pp_microbatches": 2}, 2),
    Layout("pp 2 x ddp 2", {"strategy": "ddp", "pp": 2, "pp_microbatches": 2}, 4),
    Layout("pp 2 x tp 2", {"strategy": "ddp", "pp": 2, "tp": 2, "pp_microbatches": 2}, 4),
    Layout("zero3, cpu_offload", {"strategy": "zero3"}, 2, cpu_offload=True),
)


def layout(name: str) -> Layout:
    for item in LAYOUTS:
        if item.name == name:
            return item
    raise ValueError(f"unknown layout {name!r}; choose one of {', '.join(item.name for item in LAYOUTS)}")


def layouts(*names: str) -> tuple[Layout, ...]:
    """The layouts named, in that order: one table's columns."""
    return tuple(layout(name) for name in names)
