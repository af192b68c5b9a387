"""The sentiment example's BERT, trained under zero3 on 2 ranks, exported with `--format hf`
(a small shard size forces several shards): `transformers` loads it with equal weights and it
predicts the same labels the trained model did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phalanx import cli
from phalanx.checkpoint.export import full_state_dict
from tests.launcher.launch_helpers import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sentiment.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentiment-export")
    result = run_cli(
        [
            "run",
            "--nproc-per-node",
            "2",
            "--strategy",
            "zero3",
            str(EXAMPLE),
            "--limit",
            "160",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--save",
            str(root / "saved"),
        ],
        env={
            "PHALANX_RUN_DIR": str(root / "run"),
            "PHALANX_STRATEGY": None,
            "PHALANX_PROGRESS": None,
            "PHALANX_TRACKERS": None,
            "PHALANX_PROFILE": None,
        },
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "strategy zero3" in result.stderr
    return root / "saved"


def test_hf_export_loads_in_transformers_with_equal_weights_and_predictions(saved, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "hf"
    assert (
        cli.main(
            [
                "export",
                str(saved / "checkpoint"),
                str(out),
                "--format",
                "hf",
                "--max-shard-size",
                "300KB",
                "--config-from",
                str(saved / "hf-config"),
            ]
        )
        == 0
    )
    assert f"phalanx export: wrote {out}" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    assert all(name.startswith("model-") and name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)

    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    expected = full_state_dict(saved / "checkpoint")
    loaded = model.state_dict()
    assert set(index["weight_map"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name

    predictions = json.loads((saved / "predictions.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    model.eval()
    with torch.no_grad():
        logits = model(
            **tokenizer(predictions["texts"], max_length=128, padding=True, truncation=True, return_tensors="pt")
        ).logits
    trained = torch.tensor(predictions["logits"])
    assert len(predictions["texts"]) == 16
    assert torch.equal(logits.argmax(-1), trained.argmax(-1))
    torch.testing.assert_close(logits, trained, rtol=1e-4, atol=1e-5)


def test_torch_format_and_bad_options(saved, tmp_path, capsys):
    out = tmp_path / "weights.pt"
    assert cli.main(["export", str(saved / "checkpoint"), str(out), "--format", "torch"]) == 0
    state = torch.load(out, weights_only=True)
    expected = full_state_dict(saved / "checkpoint")
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected)
    capsys.readouterr()
    assert (
        cli.main(
            [
                "export",
                str(saved / "checkpoint"),
                str(tmp_path / "x"),
                "--format",
                "hf",
                "--max-shard-size",
                "5 parsecs",
            ]
        )
        == 2
    )
    assert "--max-shard-size '5 parsecs': expected a size such as 5GB" in capsys.readouterr().err
    assert (
        cli.main(
            ["export", str(saved / "checkpoint"), str(tmp_path / "x"), "--format", "hf", "--config-from", str(tmp_path)]
        )
        == 2
    )
    assert f"--config-from {tmp_path}: no config.json there" in capsys.readouterr().err
    assert cli.main(["export", str(saved / "checkpoint"), str(out), "--max-shard-size", "1GB"]) == 2
    assert "--max-shard-size and --config-from apply to --format hf only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
