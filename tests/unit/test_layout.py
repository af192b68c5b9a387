"""The layout object (strategies/layout.py) is the one place that makes process groups and
flattened sub-meshes from the plan: every feature asks it by name."""

from __future__ import annotations

import re
from pathlib import Path

from phalanx.strategies.plan import presets
from phalanx.strategies.layout import SPANS, Layout
from phalanx.strategies.plan.parallel_plan import MESH_DIMS

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

# torch's calls that make a process group or a mesh (and with it, groups)
MAKES_GROUPS = re.compile(
    r"\bnew_group\(|\bnew_subgroups\w*\(|\._flatten\(|\binit_device_mesh\(|\bDeviceMesh\("
    r"|\bsplit_group\("
)

# groups that are not the layout's, each with its reason
ELSEWHERE = {
    "data/join_collectives.py": "the ranks still stepping under torch's Join: known at run time, not from the plan",
    "checkpoint/manager.py": "a gloo side channel over the world for async saves (a room below strategies/)",
    "strategies/optimizers/sharded_optimizer.py": "a zero1 optimizer the script built itself: a mesh over its own group's ranks",
}


def test_no_group_or_flattened_mesh_is_made_outside_the_layout():
    making = {path.relative_to(SRC).as_posix() for path in SRC.rglob("*.py") if MAKES_GROUPS.search(path.read_text())}
    assert making - set(ELSEWHERE) == {"strategies/layout.py"}, "ask the Layout (layout.group/mesh) by name"
    assert set(ELSEWHERE) - making == set(), "ELSEWHERE names a module that no longer makes a group"


def test_every_derived_group_spans_mesh_dims():
    for name, span in SPANS.items():
        assert set(span.dims) <= set(MESH_DIMS) and span.alone in span.dims, name


def test_a_world_of_one_has_no_mesh_and_no_groups():
    layout = Layout.build(presets.build("auto", presets.asking(), world_size=1, local_world_size=1), "cpu")
    assert layout.root is None
    assert [layout.group(name) for name in (*MESH_DIMS, *SPANS)] == [None] * (len(MESH_DIMS) + len(SPANS))
