"""Issue 54 item 6: noise a newcomer cannot act on, as the user sees it through `phalanx run`."""

import json

import pytest

from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

LOADER_OF_8 = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
from phalanx import Phalanx

px = Phalanx()
model = torch.nn.Linear(4, 1)
loader = DataLoader(TensorDataset(torch.zeros(32, 4)), batch_size=8)
model, loader = px.prepare(model, loader)
"""


def test_a_deepspeed_micro_batch_the_loader_does_not_have_is_one_refusal(tmp_path):
    """It was a traceback on every rank (exit 1); the loader's batch size is only known at prepare,
    so it is prepare's refusal: one line from the launcher, exit 2."""
    (tmp_path / "train.py").write_text(LOADER_OF_8)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    result = run_cli(["run", "--nproc-per-node", "2", "--deepspeed", "ds.json", "train.py"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert (
        f"phalanx run: error: DeepSpeed config '{tmp_path / 'ds.json'}' sets train_micro_batch_size_per_gpu=4 but "
        "the DataLoader has batch_size=8. HINT: build the DataLoader with batch_size=4 (px.micro_batch_size), "
        "or drop the key."
    ) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
