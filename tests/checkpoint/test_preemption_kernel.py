"""Preemption where the process is shared: in a Jupyter kernel, a script (or the kernel's event loop)
setting its own `signal.set_wakeup_fd` and a second `Phalanx()` in the same process must not lose the
signal; and a world of one stops at a step boundary, never in the middle of an evaluation loop."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

pytestmark = pytest.mark.timeout(200)

TRAIN = """
def train(px, signal_at=2):
    model = nn.Linear(2, 1)
    model, opt, loader = px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=4))
    try:
        for step, (x,) in enumerate(loader):
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(1.5)  # the signal is heard meanwhile
            px.backward(model(x).sum())
            opt.step()
            opt.zero_grad()
        return "not stopped"
    except SystemExit as stop:
        return f"stopped {stop.code} at step {px.global_step}"
"""

CELLS = [
    "import os, signal, time, torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
    "from phalanx import Phalanx\n" + TRAIN,
    # the script sets its own wakeup fd after Phalanx() took it
    "px = Phalanx(checkpoint_dir='ckpt1')\nread_end, write_end = os.pipe()\nos.set_blocking(write_end, False)\n"
    "signal.set_wakeup_fd(write_end)\nprint('FIRST', train(px))",
    # the cell run again: a second Phalanx() in the same process
    "px = Phalanx(checkpoint_dir='ckpt2')\nprint('SECOND', train(px))",
]


def test_preemption_in_a_notebook_kernel_survives_a_changed_wakeup_fd_and_a_second_phalanx(tmp_path, monkeypatch):
    from tests.dist.test_spawn_and_adopt import script_env
    from tests.notebook import run_cells

    stdout = run_cells(
        CELLS, tmp_path, monkeypatch, {**script_env(), "PHALANX_RUN_DIR": str(tmp_path / "runs")}, timeout=150
    )
    # the signal in step 2 is acted on at the next step boundary: after step 3's optimizer step
    assert "FIRST stopped 138 at step 3" in stdout, stdout
    assert "SECOND stopped 138 at step 3" in stdout, stdout
    assert (tmp_path / "ckpt1" / "step-00000003").is_dir() and (tmp_path / "ckpt2" / "step-00000003").is_dir()


def test_a_world_of_one_stops_at_a_step_boundary_not_in_an_eval_loop(tmp_path, monkeypatch):
    """It stopped at the eval loader's next batch: in the middle of the evaluation."""
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path / "runs"))
    px = Phalanx(checkpoint_dir=tmp_path / "ckpt")
    model = nn.Linear(2, 1)
    data = TensorDataset(torch.randn(16, 2))
    model, opt, train, evaluation = px.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=4),
        DataLoader(data, batch_size=2),
    )
    evaluated = []
    with pytest.raises(SystemExit) as stop:
        for _ in range(3):
            for (x,) in train:
                px.backward(model(x).sum())
                opt.step()
                opt.zero_grad()
            for i, (_x,) in enumerate(evaluation):  # after step 4: the signal arrives in its 2nd batch
                if i == 1 and px.global_step == 4:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(1.0)
                evaluated.append(px.global_step)
    assert stop.value.code == 138
    assert evaluated == [4] * 8  # the whole evaluation ran
    assert px.global_step == 5 and (tmp_path / "ckpt" / "step-00000005").is_dir()  # the next step's boundary
