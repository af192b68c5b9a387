"""A checkpoint of an FSDP2-sharded model (2 ranks, each writing only its shard) loads into a plain
model and optimizer in one process: zero3 -> single/ddp across strategies and world sizes."""

import pytest
import torch

from phalanx import Phalanx
from phalanx.checkpoint.manifest import read_manifest
from tests.checkpoint.resumable import make_model
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(200)]


def test_fsdp2_checkpoint_loads_into_a_plain_model(tmp_path):
    path = tmp_path / "zero3-step-3"
    saved = run_ranks("tests.checkpoint.sharded:save_fsdp", 2, args=(str(path),), timeout=150)[0]
    assert saved["local_shapes"]["0.weight"] == (16, 13), "each rank held half of the first layer"
    manifest = read_manifest(path)
    assert (manifest.world_size, manifest.strategy, manifest.step) == (2, "zero3", 3)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest.files)

    px = Phalanx()
    model = make_model(0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = px.prepare(model, optimizer)
    assert px.load_state(path) and px.global_step == 3
    for name, expected in saved["params"].items():
        assert torch.equal(model.state_dict()[name], expected), name
    names = [n for n, _ in model.named_parameters()]
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                optimizer.state[optimizer.param_groups[0]["params"][index]][key], saved["optim_state"][name][key]
            ), (name, key)
