"""Loading a checkpoint never runs code, whatever its bytes (issue 52, item 1).

Each payload below is a pickle that, if it ran, would create a marker directory (`os.mkdir`), reached
by every route pickle offers to a callable: GLOBAL and STACK_GLOBAL, a dotted name resolved through
a module the metadata reader allows (protocol 4 walks `torch.distributed.checkpoint.metadata.os.mkdir`),
REDUCE, BUILD (after NEWOBJ), INST, OBJ and a registered extension code. Each is planted in `.metadata`, in
the side files (`common.pt`, `rank0.pt`, raw and inside torch's zip) and in the manifest, with the
manifest's sha256 rewritten to match, as an attacker with write access would. Resume, `phalanx
export` and `phalanx inspect --verify` must each refuse it with a phalanx message that names the
file, resume falling back to the last good step; nothing runs. One process, no process group."""

from __future__ import annotations

import argparse
import copyreg
import io
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from phalanx import Phalanx
from phalanx.cli import main as cli_main
from phalanx.checkpoint import export, inspect_command
from phalanx.checkpoint.manager import CheckpointFallbackWarning
from phalanx.checkpoint.manifest import MANIFEST_NAME, CheckpointDamaged, hash_file, read_manifest, write_manifest

EXT_CODE = 0x7FF0  # an extension code this test registers for os.mkdir (copyreg's private range)


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE of `text`."""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _payloads(marker: str) -> dict[str, bytes]:
    m = marker.encode()
    proto4 = b"\x80\x04"
    return {
        # protocol 0: GLOBAL 'os mkdir', a tuple, REDUCE
        "GLOBAL+REDUCE": b"cos\nmkdir\n(S'" + m + b"'\ntR.",
        # protocol 4: STACK_GLOBAL ('posix', 'mkdir'), REDUCE
        "STACK_GLOBAL+REDUCE": proto4 + _s("posix") + _s("mkdir") + b"\x93" + _s(marker) + b"\x85R.",
        # protocol 4: a dotted name through the module DCP's metadata lives in (it imports os)
        "dotted name via metadata module": proto4
        + _s("torch.distributed.checkpoint.metadata")
        + _s("os.mkdir")
        + b"\x93"
        + _s(marker)
        + b"\x85R.",
        # ...and through torch itself, whose dtypes the reader allows by name
        "dotted name via torch": proto4 + _s("torch") + _s("os.mkdir") + b"\x93" + _s(marker) + b"\x85R.",
        # BUILD: an allowed object whose state holds the call
        "BUILD": proto4
        + _s("collections")
        + _s("OrderedDict")
        + b"\x93)\x81}"
        + _s("x")
        + _s("os")
        + _s("mkdir")
        + b"\x93"
        + _s(marker)
        + b"\x85Rsb.",
        # INST: protocol 0's class-and-arguments opcode
        "INST": b"(S'" + m + b"'\nios\nmkdir\n.",
        # OBJ: protocol 1's
        "OBJ": b"(cos\nmkdir\nS'" + m + b"'\no.",
        # EXT2: a registered extension code for os.mkdir (registered by the test, as a hostile import could)
        "extension code": b"\x80\x02\x83"
        + EXT_CODE.to_bytes(2, "little")
        + b"X"
        + len(m).to_bytes(4, "little")
        + m
        + b"\x85R.",
    }


def _zipped(payload: bytes) -> bytes:
    """`payload` as the data.pkl of an otherwise genuine torch.save archive."""
    buf = io.BytesIO()
    torch.save({"global_step": 1}, buf)
    genuine = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in genuine.namelist():
            archive.writestr(name, payload if name.endswith("data.pkl") else genuine.read(name))
    return out.getvalue()


VICTIMS = [".metadata", "common.pt", "rank0.pt", "rank0.pt (zip)", MANIFEST_NAME]
PAYLOADS = list(_payloads("x"))


@pytest.fixture(scope="module")
def good_root(tmp_path_factory) -> Path:
    """A checkpoint root with two intact steps of a tiny model, saved in this process."""
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    px = Phalanx(checkpoint_dir=str(root), seed=0)
    model, optimizer = _build(px)
    for _ in range(2):
        px.backward(model(torch.ones(3, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        px.save_state()
    return root


def _build(px: Phalanx) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return px.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def extension():
    copyreg.add_extension("os", "mkdir", EXT_CODE)
    yield
    copyreg.remove_extension("os", "mkdir", EXT_CODE)


def _plant(root: Path, victim: str, payload: bytes) -> str:
    """Write `payload` into step 2's `victim` and rewrite the manifest to match; return the file's name."""
    step = root / "step-00000002"
    name = victim.split()[0]
    (step / name).write_bytes(_zipped(payload) if victim.endswith("(zip)") else payload)
    if name != MANIFEST_NAME:
        manifest = read_manifest(step)
        manifest.files[name] = hash_file(step / name)
        write_manifest(step, manifest)
    return name


@pytest.mark.parametrize("victim", VICTIMS)
@pytest.mark.parametrize("kind", PAYLOADS)
def test_no_payload_runs_and_resume_falls_back(good_root, tmp_path, victim, kind, extension, capsys):
    marker = tmp_path / "RAN"
    root = tmp_path / "ckpt"
    shutil.copytree(good_root, root)
    name = _plant(root, victim, _payloads(str(marker))[kind])

    # resume: the planted step is refused, naming the file, and the last good step is loaded
    px = Phalanx(checkpoint_dir=str(root), seed=0)
    _build(px)
    with pytest.warns(CheckpointFallbackWarning) as caught:
        assert px.load_state() is True
    message = next(str(w.message) for w in caught if issubclass(w.category, CheckpointFallbackWarning))
    assert name in message and "step-00000001" in message, message
    if name != MANIFEST_NAME:
        assert "refus" in message or "not readable" in message, message
        assert "weights_only` set to `False`" not in message  # torch's advice to load unsafely is never passed on
    assert px.global_step == 1

    # `phalanx export` of the root takes step 1; of step 2 by name, it refuses naming the file
    assert export.resolve(root) == root / "step-00000001"
    with pytest.raises(CheckpointDamaged, match=name.replace(".", r"\.")):
        export.resolve(root / "step-00000002")
    assert cli_main(["export", str(root / "step-00000002"), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "phalanx export: error: " in err and name in err and "Traceback" not in err, err
    assert not (tmp_path / "out.safetensors").exists()

    # `phalanx inspect --verify` names the file and exits 1 (the manifest's own damage: before verify)
    args = argparse.Namespace(checkpoint=str(root / "step-00000002"), verify=True, json=False)
    assert inspect_command.main(args) == 1
    out = capsys.readouterr().out
    assert name in out and ("DAMAGED" in out or "manifest corrupted" in out), out

    assert not marker.exists(), f"{kind} in {victim} ran code"


def test_the_allowlist_is_exact_pairs(good_root):
    """The reader takes a genuine .metadata and nothing by a dotted or module-wide name."""
    from phalanx.checkpoint.safe_io import allowed_global, load_metadata

    assert load_metadata(good_root / "step-00000002" / ".metadata").state_dict_metadata
    assert allowed_global("torch.distributed.checkpoint.metadata", "Metadata")
    assert allowed_global("torch", "float32") and allowed_global("torch", "Size")
    for module, name in [
        ("torch.distributed.checkpoint.metadata", "os"),
        ("torch.distributed.checkpoint.metadata", "torch"),
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.metadata", "field"),
        ("torch", "load"),
        ("torch", "float32.__class__"),
        ("pathlib", "os.system"),
        ("builtins", "eval"),
    ]:
        assert not allowed_global(module, name), (module, name)
    assert os.path.exists(good_root)


def test_a_planted_metadata_in_s3_is_refused_and_resume_falls_back(good_root, s3, tmp_path, monkeypatch):
    """The S3 path reads through the same readers: a dotted-name payload in an uploaded `.metadata`
    (manifest rewritten to match) is refused and resume loads step 1 from the bucket."""
    marker = tmp_path / "RAN"
    root = tmp_path / "ckpt"
    shutil.copytree(good_root, root)
    _plant(root, ".metadata", _payloads(str(marker))["dotted name via metadata module"])
    client = s3.client()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        client.upload_file(str(path), "phalanx-ckpt", f"hostile/{path.relative_to(root)}")
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    px = Phalanx(checkpoint_dir=s3.url("hostile"), seed=0)
    _build(px)
    with pytest.warns(CheckpointFallbackWarning, match=r"\.metadata: it refers to .*os\.mkdir"):
        assert px.load_state() is True
    assert px.global_step == 1
    assert not marker.exists()
