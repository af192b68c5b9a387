"""One uninterrupted 2-rank run (40 steps, a checkpoint every 5, all kept), shared by the tests here."""

import json
from pathlib import Path

import pytest
import torch

from tests.dist.harness import run_ranks

RESUMABLE = "tests.checkpoint.resumable:run"


def read_events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("reference")
    (base / "out").mkdir()
    results = run_ranks(RESUMABLE, 2, args=(str(base / "ckpt"), str(base / "out"), 40, 5), timeout=150)
    return {
        "ckpt": base / "ckpt",
        "events": read_events(base / "out"),
        "results": results,
        "final": torch.load(base / "out" / "final.pt", weights_only=True),
    }


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on a free loopback port, for the whole session (tests/checkpoint/s3_server.py)."""
    pytest.importorskip("moto", reason="moto[server] is a test dependency: pip install -e '.[test]'")
    pytest.importorskip("s3fs", reason="s3fs is the s3 extra: pip install -e '.[s3]'")
    from tests.checkpoint.s3_server import s3_server

    with s3_server(tmp_path_factory.mktemp("moto")) as server:
        yield server
