"""The layout object (strategies/layout.py) is the one place that makes process groups and
flattened sub-meshes from the plan: every feature asks it by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.strategies.plan import presets
from phalanx.strategies.layout import SPANS, Layout
from phalanx.strategies.plan.parallel_plan import MESH_DIMS, Sharding

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


PLANS = {  # plan fields -> a world on torch's fake backend (rank 0 of it: no peer, no work)
    "ddp": dict(preset="ddp", dp_replicate=2),
    "zero3 x tp": dict(preset="zero3", dp_shard=2, tp=2, sharding=Sharding.PARAMETERS),
    "hsdp x cp": dict(preset="hsdp", dp_replicate=2, dp_shard=2, cp=2, sharding=Sharding.PARAMETERS),
    "pp x zero3 x tp": dict(preset="zero3", pp=2, dp_shard=2, tp=2, sharding=Sharding.PARAMETERS),
    "ep x tp under zero3": dict(preset="zero3", dp_shard=4, tp=2, ep=2, sharding=Sharding.PARAMETERS),
    "pp x ddp x ep": dict(preset="ddp", pp=2, dp_replicate=4, ep=2),
}


@pytest.fixture
def fake_world():
    """init_process_group on torch's fake backend (its groups do no work), torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _groups_made() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


@pytest.mark.parametrize("layout_name", list(PLANS))
def test_every_group_is_built_with_the_layout_and_asking_makes_none(fake_world, layout_name):
    """Groups and meshes are built once, eagerly, in `Layout.build` (issue 53 item 3): asking for any
    of them afterwards, in any order, makes no group, so ranks that ask in different orders cannot hang."""
    from phalanx.strategies.layout import JOINED, PARTS
    from phalanx.strategies.plan.parallel_plan import ParallelPlan

    plan = ParallelPlan(**PLANS[layout_name])
    fake_world(plan.world_size)
    layout = Layout.build(plan, "cpu")
    built = _groups_made()
    names = [*MESH_DIMS, *SPANS] + ["fully_shard"] * plan.uses_fsdp
    names += [*PARTS, *(JOINED if plan.tp > 1 else ())] if plan.ep > 1 else []
    for name in reversed(names):  # the reverse of build's order
        layout.mesh(name)
        if name not in JOINED and name != "fully_shard":
            layout.group(name)
    assert _groups_made() == built, f"{layout_name}: asking made {_groups_made() - built} group(s)"


def test_the_private_device_mesh_calls_exist_in_the_installed_torch():
    """The layout's three private DeviceMesh calls (no public equivalent in torch 2.13): a torch that
    renames one fails here, not in a user's job."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    missing = [name for name in ("_flatten", "_unflatten", "_concatenate") if not hasattr(DeviceMesh, name)]
    assert not missing, f"torch {torch.__version__} has no DeviceMesh.{missing}: update strategies/layout.py"
