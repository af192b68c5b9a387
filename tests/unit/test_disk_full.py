"""The disk-full sentence: on ENOSPC, and on torch's zip-writer error when the space free is short."""

import shutil

from phalanx.checkpoint import disk_full
from phalanx.checkpoint.object_path import location

ZIP_WRITER = "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def test_the_zip_writer_error_is_named_a_full_disk_when_less_is_free_than_needed(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    text = disk_full.note(tmp_path / "ckpt", [ZIP_WRITER], lambda: free * 2)
    assert text.startswith(
        f"the filesystem of the checkpoint directory {tmp_path / 'ckpt'} is full: "
        f"the checkpoint needs about {free * 2} bytes ("
    )
    assert "bytes are free (" in text and "HINT" not in text  # the fix goes last in the whole message


def test_the_zip_writer_error_with_room_to_spare_is_left_alone(tmp_path):
    assert disk_full.note(tmp_path, [ZIP_WRITER], lambda: 1) is None


def test_enospc_is_always_named_and_other_errors_never(tmp_path):
    assert "is full" in disk_full.note(tmp_path, ["OSError: [Errno 28] No space left on device"], lambda: 1)
    assert disk_full.note(tmp_path, ["PermissionError: [Errno 13] Permission denied"], lambda: 1) is None
    assert disk_full.note(location("s3://bucket/run"), ["No space left on device"], lambda: 1) is None
