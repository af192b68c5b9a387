"""A failed or odd save says what is true (issue 52): a `.staging-*` symbolic link is removed as a
link, its target left, and said so; a foreign `step-N` beside a save that fails on a full disk does
not hide the write error behind its own CheckpointDamaged. Real files, a real full tmpfs, one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phalanx.checkpoint import atomic
from phalanx.checkpoint.save_attempt import CheckpointWriteError, SaveAttempt
from tests.checkpoint.test_storage_faults import small_tmpfs
from tests.dist.harness import ROOT

pytestmark = pytest.mark.timeout(120)


def _plant_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not a checkpoint's")
    root = tmp_path / "linked"
    root.mkdir()
    (root / ".staging-step-00000003").symlink_to(target)
    return root, target


def test_a_staging_link_is_removed_as_a_link_and_a_foreign_step_dir_does_not_hide_a_full_disk(tmp_path):
    linked, target = _plant_link(tmp_path)
    with small_tmpfs(tmp_path / "full", size="256k") as full:
        (full / "step-00000099").mkdir()  # someone else's directory, no manifest
        (full / "step-00000099" / "notes.txt").write_text("mine")
        with open(full / "filler", "wb") as fp:  # the disk full before the save
            fp.write(b"\0" * (256 * 1024 - 8192))
        out = tmp_path / "results.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        saves = [str(linked / "step-00000003"), str(full / "step-00000007")]
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests/checkpoint/save_words.py"), str(tmp_path / "run"), *saves, str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=100,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(out.read_text())
    # the link: removed as a link, said so, its target untouched; the save then went through
    assert results[saves[0]] == "saved", results[saves[0]]
    assert (
        f"phalanx: the staging path {linked}/.staging-step-00000003, left by an interrupted save, was a symbolic "
        f"link to {target}: the link was removed, its target left as it was"
    ) in proc.stderr
    assert (target / "keep.txt").read_text() == "not a checkpoint's"
    assert atomic.is_published(linked / "step-00000003")
    # the full disk: the write error, not the foreign directory's CheckpointDamaged
    failed = results[saves[1]]
    assert failed.startswith(f"CheckpointWriteError: saving checkpoint step 1 to {full}/step-00000007 failed"), failed
    assert "No space left on device" in failed and "CheckpointDamaged" not in failed
    assert f"there is no good checkpoint in {full} yet" in failed


def test_a_failed_save_whose_staging_is_a_link_says_the_link_was_removed_and_not_its_target(tmp_path):
    root, target = _plant_link(tmp_path)
    attempt = SaveAttempt(root / "step-00000003", root / ".staging-step-00000003", 3)
    with pytest.raises(CheckpointWriteError) as raised:
        attempt.fail([(0, "OSError: [Errno 5] Input/output error", False)])
    assert (
        f"the staging path {root}/.staging-step-00000003 was a symbolic link to {target}: the link was removed, "
        "its target left as it was and latest was left as it was"
    ) in str(raised.value)
    assert not (root / ".staging-step-00000003").is_symlink() and (target / "keep.txt").is_file()
