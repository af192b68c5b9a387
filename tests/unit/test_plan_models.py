"""`phalanx plan` on training scripts: the script's own model class is found; bad MODELs get an
error naming the fix (exit 2), never a traceback."""

from __future__ import annotations

from pathlib import Path

from phalanx import cli
from phalanx.plan import command as plan_command

WINE = Path(__file__).resolve().parents[2] / "examples" / "wine.py"


def test_a_script_with_one_model_class_is_planned(capsys):
    assert cli.main(["plan", str(WINE), "--world-size", "2", "--budget", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "model: 1,091 trainable parameters" in out  # 13*64+64 + 64*3+3
    assert "auto would pick: ddp (ddp needs" in out


def test_world_size_defaults_to_what_phalanx_run_would_start(capsys, monkeypatch):
    from phalanx.launch import devices

    monkeypatch.setattr(devices, "count_visible_gpus", lambda: 0)
    assert cli.main(["plan", str(WINE), "--budget", "1GB"]) == 0
    assert "world_size 2" in capsys.readouterr().out


def test_several_model_classes_are_listed_to_pick_from(tmp_path):
    (tmp_path / "two.py").write_text(
        "import torch\nclass A(torch.nn.Linear):\n    def __init__(self):\n"
        "        super().__init__(2, 2)\nclass B(A):\n    pass\n"
        "class NeedsArgs(torch.nn.Linear):\n    pass\n"
    )
    try:
        plan_command.load_factory(str(tmp_path / "two.py"))
    except ValueError as error:
        message = str(error)
    assert message == (
        f"'{tmp_path / 'two.py'}' defines several models that need no arguments: pick one, "
        f"e.g. {tmp_path / 'two.py'}:A, {tmp_path / 'two.py'}:B"
    )


def test_bad_models_are_one_line_errors_with_the_fix(capsys, tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('no data here')\n")
    cases = [
        ([str(tmp_path / "nope.py")], f"phalanx plan: error: model file '{tmp_path / 'nope.py'}' does not exist"),
        (
            [f"{WINE}:load_data"],
            f"phalanx plan: error: {WINE}:load_data returned tuple, not a torch.nn.Module. "
            "HINT: pass file.py:NAME, where NAME() returns the model",
        ),
        (
            [f"{WINE}:Nope"],
            f"phalanx plan: error: '{WINE}' has no 'Nope'. HINT: pass {WINE}:NAME, where NAME() "
            "builds and returns the nn.Module (it defines: SimpleNN, load_data, main), or add a "
            "make_model() function to the file.",
        ),
        (
            [str(tmp_path / "broken.py")],
            f"phalanx plan: error: importing '{tmp_path / 'broken.py'}' failed: RuntimeError: no data here",
        ),
        (["no_such_module_xyz:f"], "phalanx plan: error: cannot import module 'no_such_module_xyz'"),
    ]
    for args, expected in cases:
        assert cli.main(["plan", *args, "--world-size", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(expected), err
        assert "Traceback" not in err


def test_the_optimizer_counted_is_the_one_the_script_builds(capsys, tmp_path):
    assert cli.main(["plan", str(WINE), "--world-size", "2", "--budget", "1GB"]) == 0
    assert "optimizer adam (read from wine.py: Adam), world_size 2" in capsys.readouterr().out
    assert cli.main(["plan", str(WINE), "--world-size", "2", "--budget", "1GB", "--optimizer", "sgd"]) == 0
    assert "optimizer sgd (--optimizer), world_size 2" in capsys.readouterr().out


def test_optimizers_read_from_source_and_what_is_assumed_otherwise(tmp_path):
    from phalanx.plan import optimizer

    def choice(source):
        (tmp_path / "train.py").write_text(source)
        return optimizer.choose(None, str(tmp_path / "train.py"))

    assert choice("opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)\n") == optimizer.OptimizerChoice(
        "sgd-momentum", "read from train.py: SGD"
    )
    assert choice("from torch.optim import SGD\nopt = SGD(m.parameters(), lr=0.1, momentum=0)\n").name == "sgd"
    assert choice("import torch\n") == optimizer.OptimizerChoice(
        "adamw", "assumed: train.py builds no torch.optim optimizer plan knows; --optimizer NAME sets it"
    )
    assert choice("a = optim.Adam(p)\nb = optim.RMSprop(q)\n") == optimizer.OptimizerChoice(
        "adamw", "assumed: train.py builds several (Adam, RMSprop); --optimizer NAME picks one"
    )
    assert optimizer.choose(None, "some.module:make") == optimizer.OptimizerChoice(
        "adamw", "assumed; --optimizer NAME sets it"
    )


def test_tensor_parallel_layouts_are_planned_per_rank_and_a_layout_is_suggested(capsys):
    # tiny Llama: 22,688 parameters; transformers' plan splits the embedding (embedding_rowwise),
    # q/k/v/o, gate/up/down and lm_head 2 ways; the 5 norms of 32 stay whole on every rank
    assert (
        cli.main(
            [
                "plan",
                "tests/dist/tp_workloads.py:tiny_llama",
                "--world-size",
                "4",
                "--tp",
                "2",
                "--optimizer",
                "sgd",
                "--input",
                "4x8",
                "--budget",
                "1GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    one_rank = ((22_688 - 5 * 32) // 2 + 5 * 32) * 4
    assert f"tensor parallel tp=2: one rank holds {one_rank / 1024:.1f} KiB of the parameters" in out
    assert "  zero3 x tp2" in out and "hsdp 1x2 x tp2" in out
    assert "suggested layout for 4 ranks: ddp x tp2 (model state + runtime + activations" in out
    assert (
        cli.main(["plan", "tests/dist/tp_workloads.py:tiny_llama", "--world-size", "4", "--tp", "4", "--input", "4x8"])
        == 2
    )
    assert "HINT: tp must divide the model's attention (and key/value) heads" in capsys.readouterr().err


def test_tensor_parallel_over_every_rank_names_ddp_not_single(capsys):
    """`phalanx plan --tp 2` on 2 ranks printed "auto would pick: single" beside its suggested layout."""
    assert (
        cli.main(
            [
                "plan",
                "tests/dist/tp_workloads.py:tiny_llama",
                "--world-size",
                "2",
                "--tp",
                "2",
                "--optimizer",
                "sgd",
                "--budget",
                "1GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "auto would pick: ddp (tp=2 takes every rank: no data-parallel ranks)" in out
    assert "single" not in out


UNGUARDED = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx

px = Phalanx()
with px.init_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
model, optimizer, loader = px.prepare(model, optimizer, loader)
for x, y in loader:
    optimizer.zero_grad()
    px.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
with open("trained.txt", "w") as fp:
    fp.write("a step ran")
"""


def test_a_script_without_a_main_guard_is_planned_without_training(capsys, tmp_path, monkeypatch):
    """Issue 54 item 1: `phalanx plan train.py` stops the script at its px.prepare (the model it was
    given), runs no step and writes nothing (no run directory, no file of the script's)."""
    import torch.distributed as dist

    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path / "run"))
    assert cli.main(["plan", "train.py", "--world-size", "2", "--budget", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "model from: train.py:11, the model passed to px.prepare (phalanx plan stopped the script there: " in out
    assert "model: 58 trainable parameters" in out  # 4*8+8 + 8*2+2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no run dir, no trained.txt
    assert not dist.is_initialized()


def test_where_the_model_came_from_is_said(capsys):
    assert cli.main(["plan", str(WINE), "--world-size", "2", "--budget", "1GB"]) == 0
    assert "model from: wine.py's class SimpleNN, built with no arguments" in capsys.readouterr().out
