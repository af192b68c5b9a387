"""One list of layouts (tests/layouts/__init__.py) makes the compatibility, models and optimizer
tables: each table's columns are items of it, and each item is a plan the presets build on its
processes. No table of layouts lives in src (test_plan_carrier's names test)."""

from __future__ import annotations

from tests import layouts
from tests.layouts import compatibility, families, optimizers


def test_every_table_takes_its_layouts_from_the_one_list():
    tables = {
        "compatibility": compatibility.LAYOUTS,
        "families": tuple(families.LAYOUTS.values()),
        "optimizers": optimizers.LAYOUTS,
    }
    for name, columns in tables.items():
        assert columns and all(any(item is one for one in layouts.LAYOUTS) for item in columns), name
    assert {item.name for columns in tables.values() for item in columns} == {item.name for item in layouts.LAYOUTS}


def test_each_layout_is_a_plan_of_its_processes():
    for item in layouts.LAYOUTS:
        plan = item.plan()
        assert plan.world_size == item.processes, item.name
        assert plan.preset == item.settings["strategy"] and plan.cpu_offload == item.cpu_offload, item.name
    assert layouts.layout("hsdp 2 x 2").plan().degrees()["dp_replicate"] == 2
