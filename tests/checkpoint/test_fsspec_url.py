"""Any fsspec filesystem serves as checkpoint_dir, not only S3: fsspec's in-memory one, in a world of
one (it is per process); and a URL is never taken for a local path."""

from __future__ import annotations

import torch
from torch import nn

from phalanx import Phalanx
from phalanx.checkpoint.object_path import ObjectPath, location


def test_urls_become_object_paths_and_paths_stay_paths(tmp_path):
    assert location("s3://bucket/run1/") == ObjectPath("s3", "bucket/run1")
    assert str(location("s3://bucket/run1") / "step-00000005") == "s3://bucket/run1/step-00000005"
    assert location("s3://bucket/run1").parent == ObjectPath("s3", "bucket")
    assert location(str(tmp_path)) == tmp_path and location(f"file://{tmp_path}") == tmp_path
    assert Phalanx(checkpoint_dir="memory://phalanx-parse/run").config.checkpoint_dir == "memory://phalanx-parse/run"


def _prepared(root: str) -> tuple:
    px = Phalanx(checkpoint_dir=root, preemption_signals="none")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return (px, *px.prepare(model, optimizer))


def test_save_and_load_through_fsspecs_memory_filesystem():
    root = "memory://phalanx-test/run1"
    px, model, optimizer = _prepared(root)
    for _ in range(2):
        optimizer.zero_grad()
        px.backward(model(torch.ones(3, 4)).sum())
        optimizer.step()
        px.save_state()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    again, model2, _ = _prepared(root)
    assert again.load_state() and again.global_step == 2
    for name, tensor in saved.items():
        assert torch.equal(model2.state_dict()[name], tensor), name
    assert (location(root) / "latest").read_text().strip() == "step-00000002"
