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
def no_phalanx_settings_from_outside():
    """Every test starts with no PHALANX_* variable (a developer's PHALANX_STRATEGY=zero3 must not
    change what the tests check), and whatever a test sets is gone afterwards: the variables as they
    were are put back."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("PHALANX_")}
    for key in saved:
        del os.environ[key]
    yield
    for key in [k for k in os.environ if k.startswith("PHALANX_")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def run_dir_in_tmp(no_phalanx_settings_from_outside, monkeypatch, tmp_path_factory):
    """Phalanx() and `phalanx run` write logs/metrics under PHALANX_RUN_DIR (default ./runs/<time>):
    keep tests' in a temporary directory of their own, outside tmp_path (tests compare tmp_path's
    files), never in the repository."""
    monkeypatch.setenv("PHALANX_RUN_DIR", str(tmp_path_factory.mktemp("phalanx-run")))
