"""docs/settings.md is what the schema generates: a new row reaches the docs without hand edits,
and a stale page fails here with the command that regenerates it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from phalanx.config import kinds, reference, schema

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_committed_reference_is_what_the_schema_generates():
    assert PAGE.read_text() == reference.reference_text(), (
        f"docs/settings.md is out of date with src/phalanx/config/schema.py. HINT: run {reference.COMMAND}"
    )


def test_every_setting_appears_once_with_its_flag_variable_and_default():
    text = reference.reference_text()
    for setting in schema.SETTINGS:
        rows = [line for line in text.splitlines() if line.startswith(f"| `{setting.name}` |")]
        assert len(rows) == 1, setting.name
        assert f"`{setting.flag}`" in rows[0]
        assert (f"`{setting.env}`" if setting.env else "(launcher)") in rows[0]


def test_a_new_row_lands_in_the_table_of_the_group_above_it(monkeypatch, tmp_path):
    new = schema.Setting(
        "sync_widgets", kinds.BOOL, False, "a setting added after the docs were written", bool_flag=True
    )
    rows = list(schema.SETTINGS)
    at = next(i for i, s in enumerate(rows) if s.name == "checkpoint_keep")
    monkeypatch.setattr(
        reference, "SETTINGS", (*rows[:at], dataclasses.replace(new, group=schema.CHECKPOINTS), *rows[at:])
    )
    text = reference.reference_text()
    section = text.split("## Checkpoints")[1].split("\n## ")[0]
    assert (
        "| `sync_widgets` | `--sync-widgets` / `--no-sync-widgets` | `PHALANX_SYNC_WIDGETS` | `false` | boolean "
        "| a setting added after the docs were written |"
    ) in section
    out = tmp_path / "settings.md"
    assert reference.main([str(out)]) == 0 and out.read_text() == text


def test_grouped_gives_each_row_the_group_above_it_and_refuses_a_row_before_any_group():
    first = schema.Setting("a", kinds.BOOL, False, "a")
    rows = schema.grouped(schema.LAUNCH, first, schema.LOGGING, dataclasses.replace(first, name="b"))
    assert [(r.name, r.group) for r in rows] == [("a", schema.LAUNCH), ("b", schema.LOGGING)]
    try:
        schema.grouped(first, schema.LAUNCH)
    except ValueError as error:
        assert str(error) == "setting 'a' comes before any group: put a Group above it"
    else:
        raise AssertionError("a row before any group was accepted")
