"""host_mmap_threshold: no layout pays for a setting it does not need (issue 44). A fixed 1 MiB
threshold cost ddp about 17% of its CPU speed (every large tensor made again, activations
included, is fresh pages); `auto` fixes it only where parameters are sharded, and an explicit
size wins everywhere."""

from __future__ import annotations

import pytest

from phalanx import Phalanx
from phalanx.config import kinds
from phalanx.host_only import host_memory
from phalanx.strategies.plan import presets


def _plan(name: str, world: int = 2, tp: int = 1):
    return presets.build(name, presets.asking(tp=tp), world_size=world, local_world_size=world)


@pytest.mark.parametrize(
    "name, world, tp, expected",
    [
        ("ddp", 2, 1, 0),
        ("zero1", 2, 1, 0),
        ("ddp", 1, 1, 0),
        ("ddp", 2, 2, 0),
        ("zero2", 2, 1, 2**20),
        ("zero3", 2, 1, 2**20),
        ("hsdp", 4, 1, 2**20),
        ("zero3", 4, 2, 2**20),
    ],
)
def test_auto_fixes_the_threshold_only_where_parameters_are_sharded(name, world, tp, expected):
    assert host_memory.threshold_for("auto", _plan(name, world, tp).frees_gathered_blocks) == expected


@pytest.mark.parametrize("value", [0, 2**20, 4 * 2**20])
def test_an_explicit_size_wins_in_every_layout(value):
    assert host_memory.threshold_for(value, True) == value
    assert host_memory.threshold_for(value, False) == value


def test_the_setting_reads_auto_or_a_size():
    kind = kinds.size_or_auto(32 * 2**20, "glibc's largest mmap threshold is 32MiB")
    assert kind.from_text("auto") == "auto" and kind.from_text(" AUTO ") == "auto"
    assert kind.from_text("1MiB") == 2**20 and kind.from_object(0) == 0
    with pytest.raises(ValueError, match="from 0 to 33554432 bytes .*, or auto"):
        kind.from_text("64MiB")


def test_a_single_process_job_leaves_glibc_alone_and_an_explicit_size_is_applied(monkeypatch, tmp_path):
    applied: list[int] = []
    monkeypatch.setattr(host_memory, "fix_mmap_threshold", applied.append)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    Phalanx(cpu=True, run_dir=str(tmp_path / "a"))
    Phalanx(cpu=True, run_dir=str(tmp_path / "b"), host_mmap_threshold="2MiB")
    assert applied == [0, 2 * 2**20]
