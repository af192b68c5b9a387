"""docs/migrating.md's "after" script runs as the guide prints it (read from the page with
markdown-it-py, not copied), under `python`, `phalanx run` and `torchrun` (issue 54 item 3: plain
python died with "Default process group has not been initialized" at its DistributedSampler(ds)).
The names the guide leaves to the reader (trainset, validset, MyModel, loss_fn, evaluate) come from
a prelude; the two 2-process launches end with the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "migrating.md"

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]  # 3 launches: 25-60 s here

PRELUDE = """\
import torch
from torch.utils.data import TensorDataset

torch.manual_seed(0)
trainset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
validset = TensorDataset(torch.randn(50, 8), torch.randint(0, 2, (50,)))
loss_fn = torch.nn.functional.cross_entropy


class MyModel(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def evaluate(model, loader):
    with torch.no_grad():
        return [torch.cat(t) for t in zip(*[(model(x).argmax(1), y) for x, y in loader])]

"""


def after_script() -> str:
    """The python block after the paragraph that starts 'After (' on the page."""
    tokens = MarkdownIt().parse(PAGE.read_text())
    for i, token in enumerate(tokens):
        if token.type == "inline" and token.content.startswith("After ("):
            fence = next(t for t in tokens[i:] if t.type == "fence")
            assert fence.info.strip() == "python"
            return fence.content
    raise AssertionError(f"{PAGE.name} has no 'After (' paragraph")


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stderr[-3000:]}"
    return result


def test_the_after_script_runs_under_python_phalanx_run_and_torchrun(tmp_path):
    script = after_script()
    assert "DistributedSampler(trainset)" in script  # the samplers stay, as the page says
    weights = {}
    for name, command in [
        ("python", [sys.executable]),
        ("phalanx", [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2"]),
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]),
    ]:
        where = tmp_path / name
        where.mkdir()
        (where / "train.py").write_text(PRELUDE + script)
        run([*command, "train.py"], where)
        weights[name] = torch.load(where / "model.pt")
    assert list(weights["python"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the whole model, saved once
    for key, value in weights["phalanx"].items():
        torch.testing.assert_close(weights["torchrun"][key], value, rtol=1e-6, atol=0)
