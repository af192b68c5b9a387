"""Host-only code (phalanx/host_only/) never engages on NCCL/CUDA: each piece is asked with the
backend a CUDA device chooses (runtime/context.py's pick: cuda -> nccl), on CPU, and does nothing;
with the CPU device's gloo, each engages."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest
import torch

import phalanx.host_only
from phalanx import host_only
from phalanx.host_only import gloo_comms, host_memory, polite_writes, step_buffers
from phalanx.runtime import context


class Untouchable:
    """A fully_shard-ed module stand-in that fails when anything is set on it."""

    def __getattr__(self, name: str):
        raise AssertionError(f"host-only code touched the module ({name})")


def _backend_of(device: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend runtime/context.py picks for a `device` job, asked on this CPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    picked, backend = context._pick_device(0, cpu=False)
    assert picked.type == device
    return backend


def test_none_engages_under_the_backend_a_cuda_device_chooses(monkeypatch):
    backend = _backend_of("cuda", monkeypatch)
    assert backend == "nccl" and not host_only.engages(backend)
    assert not host_only.engages("cpu:gloo,cuda:nccl")  # a mixed group: a CUDA job
    monkeypatch.setattr(step_buffers.StepBuffers, "__init__", lambda *a: pytest.fail("StepBuffers made"))
    assert gloo_comms.use_gloo_collectives([Untouchable()], [Untouchable()], backend) is False
    monkeypatch.setattr(host_memory, "fix_mmap_threshold", lambda t: pytest.fail("mallopt called"))
    assert host_memory.fix_for(backend, "auto", True) is False
    assert host_memory.fix_for(backend, 2**20, False) is False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a one-process CUDA job saving
    assert polite_writes.engages_here() is False


def test_each_engages_under_the_backend_a_cpu_device_chooses(monkeypatch):
    backend = _backend_of("cpu", monkeypatch)
    assert backend == "gloo" and host_only.engages(backend)
    applied = []
    monkeypatch.setattr(host_memory, "fix_mmap_threshold", applied.append)
    host_memory.fix_for(backend, "auto", True)
    assert applied == [host_memory.GATHERED_BLOCKS_THRESHOLD]
    assert polite_writes.engages_here() is True  # no process group, CUDA unused


def test_every_host_only_module_says_why_and_that_it_never_engages_on_nccl():
    folder = Path(phalanx.host_only.__file__).parent
    modules = [m.name for m in pkgutil.iter_modules([str(folder)])]
    assert sorted(modules) == ["gloo_comms", "host_memory", "polite_writes", "step_buffers"]
    for name in modules:
        text = (folder / f"{name}.py").read_text()
        assert "Host-only (phalanx/host_only/)" in text, name
        assert f"`{name}.py`" in phalanx.host_only.__doc__, name
