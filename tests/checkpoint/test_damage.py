"""Damaged checkpoints are refused with a message naming the bad file, `latest` falls back to the
newest intact one, nothing is ever overwritten, and loading never runs code from the files.

The checkpoints come from the shared 2-rank reference run; loads here run in this process (a
world of one, which also exercises resharding 2 -> 1) except the one 2-rank fallback check."""

import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from phalanx import Phalanx
from phalanx.checkpoint.manifest import MANIFEST_NAME, CheckpointDamaged
from phalanx.checkpoint.safe_io import verify
from tests.checkpoint.resumable import build, load_report
from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def copy_root(reference: dict, dest: Path, steps=(35, 40)) -> Path:
    for step in steps:
        shutil.copytree(reference["ckpt"] / f"step-{step:08d}", dest / f"step-{step:08d}")
    (dest / "latest").write_text(f"step-{max(steps):08d}\n")
    return dest


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated shard": (
        lambda d: truncate(d / "__1_0.distcp"),
        "__1_0.distcp: .* bytes, the manifest says .* \\(truncated",
    ),
    "deleted shard": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp: missing"),
    "corrupted manifest": (
        lambda d: (d / MANIFEST_NAME).write_text('{"step": 40, "files": '),
        "manifest.json: manifest corrupted",
    ),
    "flipped byte in a shard": (lambda d: flip_byte(d / "__1_0.distcp"), "__1_0.distcp: sha256 .* \\(corrupted\\)"),
    "deleted metadata": (lambda d: (d / ".metadata").unlink(), "\\.metadata: missing"),
    "damaged rng file": (lambda d: truncate(d / "rank1.pt"), "rank1.pt: .* \\(truncated"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_latest_falls_back_to_the_previous_intact_checkpoint(reference, tmp_path, damage):
    apply, message = DAMAGES[damage]
    root = copy_root(reference, tmp_path)
    apply(root / "step-00000040")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    report = load_report(str(root))
    assert report["loaded"] and report["step"] == 35
    assert len(report["warnings"]) == 1
    assert "skipped damaged checkpoint" in report["warnings"][0]
    assert re.search(message, report["warnings"][0]), report["warnings"][0]
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before, "loading changed files"


def test_damage_seen_by_one_rank_makes_every_rank_fall_back(reference, tmp_path):
    """Two ranks verify a share of the files each; both must skip step 40 and load step 35."""
    root = copy_root(reference, tmp_path)
    truncate(root / "step-00000040" / "rank1.pt")
    truncate(root / "step-00000040" / ".metadata")
    reports = run_ranks("tests.checkpoint.resumable:load_report", 2, args=(str(root),), timeout=120)
    for report in reports:
        assert report["loaded"] and report["step"] == 35
        assert "rank1.pt" in report["warnings"][0] and ".metadata" in report["warnings"][0]


def test_a_damaged_checkpoint_named_explicitly_is_refused_and_nothing_changes(reference, tmp_path):
    root = copy_root(reference, tmp_path)
    truncate(root / "step-00000040" / "__1_0.distcp")
    px = Phalanx()
    model, *_ = build(px)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointDamaged, match=r"refusing to load damaged checkpoint .*__1_0\.distcp"):
        px.load_state(root / "step-00000040")
    assert px.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(reference, tmp_path):
    root = copy_root(reference, tmp_path)
    for step in (35, 40):
        (root / f"step-{step:08d}" / "common.pt").unlink()
    with pytest.raises(CheckpointDamaged, match=r"every checkpoint under .* is damaged.*HINT"):
        load_report(str(root))


def test_no_checkpoint_returns_false_and_changes_nothing(tmp_path):
    px = Phalanx(checkpoint_dir=tmp_path / "none-yet")
    model, *_ = build(px)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert px.load_state() is False
    assert px.global_step == 0 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_torn_save_is_ignored_and_cleared_then_nothing_is_overwritten(reference, tmp_path):
    """A kill during save leaves `.staging-*` without a manifest: load ignores it, the next save of that
    step replaces it, and a save onto an existing checkpoint is refused with its files untouched."""
    root = copy_root(reference, tmp_path, steps=(35,))
    torn = root / ".staging-step-00000040"
    shutil.copytree(reference["ckpt"] / "step-00000040", torn)
    (torn / MANIFEST_NAME).unlink()
    px = Phalanx(checkpoint_dir=root)
    build(px)
    assert px.load_state() and px.global_step == 35
    px._checkpointer.global_step = 40  # as if five more steps were taken
    assert px.save_state() == str(root / "step-00000040")
    assert not torn.exists() and (root / "latest").read_text().strip() == "step-00000040"
    published = {p: p.read_bytes() for p in (root / "step-00000040").iterdir()}
    with pytest.raises(FileExistsError, match="never overwrites"):
        px.save_state()
    with pytest.raises(FileExistsError, match="never overwrites"):
        px.save_state(root / "step-00000035")
    assert {p: p.read_bytes() for p in (root / "step-00000040").iterdir()} == published


def test_keep_last_k_prunes_older_checkpoints(tmp_path):
    px = Phalanx(checkpoint_dir=tmp_path, checkpoint_keep=2)
    build(px)
    for step in (5, 10, 15):
        px._checkpointer.global_step = step
        px.save_state()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000010", "step-00000015"]


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("victim", [".metadata", "common.pt", "rank0.pt"])
def test_loading_never_runs_code_from_checkpoint_files(reference, tmp_path, victim, monkeypatch):
    """A crafted pickle (with a matching manifest, as an attacker would write) is refused, not run."""
    from phalanx.checkpoint.manifest import hash_file, read_manifest, write_manifest

    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step-00000040"
    shutil.copytree(reference["ckpt"] / "step-00000040", ckpt)
    if victim == ".metadata":
        (ckpt / victim).write_bytes(pickle.dumps(_Boom()))
    else:
        torch.save({"evil": _Boom()}, ckpt / victim)
    manifest = read_manifest(ckpt)
    manifest.files[victim] = hash_file(ckpt / victim)
    write_manifest(ckpt, manifest)
    px = Phalanx()
    build(px)
    with pytest.raises(
        (pickle.UnpicklingError, RuntimeError), match="refusing|Weights only load failed|Unsupported global"
    ):
        px.load_state(ckpt)
    assert not (tmp_path / "PWNED").exists()


def test_after_falling_back_the_run_saves_the_damaged_step_afresh(reference, tmp_path):
    """Resumed from step 35 past a damaged step 40, the run reaches step 40 again: the damaged
    checkpoint is moved aside (kept for inspection), not overwritten and not an error."""
    root = copy_root(reference, tmp_path / "ckpt")
    flip_byte(root / "step-00000040" / "__1_0.distcp")
    (tmp_path / "out").mkdir()
    run_ranks("tests.checkpoint.resumable:run", 1, args=(str(root), str(tmp_path / "out"), 40, 5), timeout=150)
    assert (root / "step-00000040.damaged" / "__1_0.distcp").is_file()
    assert (root / "latest").read_text().strip() == "step-00000040"
    assert verify(root / "step-00000040").step == 40
