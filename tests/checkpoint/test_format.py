"""The checkpoint format: optimizer state saved flattened (format 2, one key per parameter, so a
checkpoint moves into and out of pipeline parallel), format 1 (torch's nested form) still read,
an unknown format refused, and parameter groups holding nothing on a rank kept through a save and
a load. One process, no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from phalanx import Phalanx
from phalanx.checkpoint import manager
from phalanx.checkpoint.manifest import MANIFEST_NAME, CheckpointDamaged


def _setup(empty_group: bool = False):
    px = Phalanx()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 5e-3}]
    if empty_group:  # as a pipeline stage holds a group of another stage's parameters
        groups.insert(1, {"params": [], "lr": 1.0})
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    model, optimizer = px.prepare(model, optimizer)
    return px, model, optimizer


def _train(model, optimizer, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _keys(path: str | Path) -> set[str]:
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _set_version(path: Path, version: int) -> None:
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["format_version"] = version
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def _assert_same(a, b) -> None:
    (_, model_a, opt_a), (_, model_b, opt_b) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(opt_a.state[p]["exp_avg"], opt_b.state[q]["exp_avg"]), name
    assert [g["lr"] for g in opt_a.param_groups if g["params"]] == [g["lr"] for g in opt_b.param_groups if g["params"]]


def test_optimizer_state_is_saved_flattened_one_key_per_parameter(tmp_path):
    saved = _setup()
    _train(*saved[1:])
    path = saved[0].save_state(tmp_path / "ckpt")
    keys = _keys(path)
    assert {
        "model.optim.state.0.weight.exp_avg",
        "model.optim.param_groups.0.weight.lr",
        "model.optim.param_groups.2.bias.lr",
    } <= keys
    assert "model.optim.param_groups.0.params" not in keys  # the nested form's list of names per group
    assert json.loads((Path(path) / MANIFEST_NAME).read_text())["format_version"] == 2


def test_format_1_nested_optimizer_state_still_loads(tmp_path, monkeypatch):
    def nested(models, optimizers, tied=None):  # what phalanx wrote before format 2
        entries = group_by_model(models, optimizers, tied)
        for entry in entries.values():
            entry.flat = False
        return entries

    group_by_model = manager.group_by_model
    saved = _setup()
    _train(*saved[1:])
    with monkeypatch.context() as patch:
        patch.setattr(manager, "group_by_model", nested)
        path = Path(saved[0].save_state(tmp_path / "ckpt"))
    _set_version(path, 1)
    assert "model.optim.param_groups.0.params" in _keys(path)  # nested: per group, its parameters' names
    loaded = _setup()
    assert loaded[0].load_state(path)
    _assert_same(saved, loaded)


def test_an_unknown_format_is_refused_naming_the_readable_ones(tmp_path):
    saved = _setup()
    path = Path(saved[0].save_state(tmp_path / "ckpt"))
    _set_version(path, 3)
    with pytest.raises(
        CheckpointDamaged,
        match=r"format version 3, this phalanx reads 1, 2. HINT: load it with the "
        r"phalanx version that wrote it",
    ):
        _setup()[0].load_state(path)


def test_a_group_with_no_parameter_here_survives_a_save_and_a_load(tmp_path):
    saved = _setup(empty_group=True)
    _train(*saved[1:])
    path = saved[0].save_state(tmp_path / "ckpt")
    assert [len(g["params"]) for g in saved[2].param_groups] == [2, 0, 2]  # put back after the save
    loaded = _setup(empty_group=True)
    for group in loaded[2].param_groups:
        group["lr"] = 0.0
    assert loaded[0].load_state(path)
    assert [len(g["params"]) for g in loaded[2].param_groups] == [2, 0, 2]
    _assert_same(saved, loaded)
    assert loaded[2].param_groups[1]["lr"] == 0.0  # nothing saved for it: left as it was
