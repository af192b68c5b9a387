"""Test-wide guards: no test may leak launcher variables or a process group into the next."""
import os

import pytest

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaked_distributed_state():
    before = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    after = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    assert before == after, f"test leaked launcher variables: {before} -> {after}"
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a process group initialised")


@pytest.fixture(autouse=True)
def run_dir_in_tmp(monkeypatch, tmp_path_factory):
    """Phalanx() writes logs/metrics under PHALANX_RUN_DIR (default ./runs/<time>): keep tests' in a
    temporary directory of their own, outside tmp_path (tests compare tmp_path's files)."""
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path_factory.mktemp("phalanx-run")))
