"""`phalanx inspect` prints the manifest; `phalanx export` writes the full weights as safetensors."""

import shutil

import torch
from safetensors.torch import load_file

from phalanx.cli import main


def test_inspect_prints_the_manifest_of_the_latest_checkpoint(reference, capsys):
    assert main(["inspect", str(reference["ckpt"]), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "latest -> step-00000040" in out
    assert "step 40, saved by 2 rank(s), strategy ddp" in out
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "rank0.pt", "rank1.pt"):
        assert name in out
    assert "verify: OK" in out


def test_inspect_verify_reports_a_damaged_file(reference, tmp_path, capsys):
    ckpt = tmp_path / "step-00000040"
    shutil.copytree(reference["ckpt"] / "step-00000040", ckpt)
    (ckpt / "__1_0.distcp").write_bytes(b"short")
    assert main(["inspect", str(ckpt), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "verify: DAMAGED" in out and "__1_0.distcp: 5 bytes, the manifest says" in out


def test_export_writes_the_final_full_weights(reference, tmp_path):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(reference["ckpt"]), str(out)]) == 0
    weights = load_file(str(out))
    assert weights.keys() == reference["final"].keys()  # the model's own names: no "module." prefix
    for name, expected in reference["final"].items():
        assert torch.equal(weights[name], expected), name
