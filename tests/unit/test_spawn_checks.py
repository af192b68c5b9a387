"""phalanx.spawn refuses, before starting any worker, what cannot work."""

from __future__ import annotations

import pytest

from phalanx.launch import spawn as spawn_module
from phalanx.launch.spawn import SpawnError, check_arguments_can_be_sent, check_can_start, spawn, spawn_start_method


def top_level():
    return 1


@pytest.mark.parametrize("nprocs", [0, -2, 1.5, "2", True])
def test_nprocs_must_be_a_positive_integer(nprocs):
    with pytest.raises(SpawnError, match=rf"nprocs must be a positive integer or None, got {nprocs!r}"):
        spawn(top_level, nprocs=nprocs)


def test_unknown_start_method():
    with pytest.raises(SpawnError, match=r"start_method must be one of auto, fork, spawn, forkserver, got 'thread'"):
        spawn(top_level, nprocs=2, start_method="thread")


def test_lambda_and_local_function_cannot_be_spawned():
    def local():
        return 2

    for fn, name in (
        (lambda: 1, "test_lambda_and_local_function_cannot_be_spawned.<locals>.<lambda>"),
        (local, "test_lambda_and_local_function_cannot_be_spawned.<locals>.local"),
    ):
        with pytest.raises(SpawnError, match=r"cannot be sent to spawned workers .*top level of a module") as error:
            check_can_start(fn, "spawn", cuda_initialised=False, interactive=False)
        assert str(error.value).startswith(name)
    check_can_start(top_level, "spawn", cuda_initialised=False, interactive=False)
    check_can_start(local, "fork", cuda_initialised=False, interactive=False)  # fork needs no pickling


def test_notebook_function_under_spawn_is_refused():
    top_level.__module__ = "__main__"
    try:
        with pytest.raises(SpawnError, match="defined in this interactive session"):
            check_can_start(top_level, "spawn", cuda_initialised=False, interactive=True)
    finally:
        top_level.__module__ = __name__


def test_fork_after_cuda_was_initialised_is_refused():
    with pytest.raises(SpawnError, match=r"CUDA is already initialised.*restart the kernel"):
        check_can_start(top_level, "fork", cuda_initialised=True, interactive=True)
    with pytest.raises(SpawnError, match=r"CUDA is already initialised.*start_method='spawn'"):
        check_can_start(top_level, "fork", cuda_initialised=True, interactive=False)
    check_can_start(top_level, "spawn", cuda_initialised=True, interactive=False)


def test_spawn_checks_run_before_any_worker(monkeypatch):
    monkeypatch.setattr(spawn_module, "_cuda_initialised", lambda: True)
    monkeypatch.setattr(spawn_module, "_launch", lambda *a: pytest.fail("a worker was started"))
    with pytest.raises(SpawnError, match="CUDA is already initialised"):
        spawn(top_level, nprocs=2, start_method="fork")


def test_start_method_choice():
    assert spawn_start_method("auto", interactive=True, num_gpus=8) == "fork"  # notebook functions only fork
    assert spawn_start_method("auto", interactive=False, num_gpus=0) == "fork"
    assert spawn_start_method("auto", interactive=False, num_gpus=2) == "spawn"
    assert spawn_start_method("spawn", interactive=True, num_gpus=0) == "spawn"


def test_unpicklable_arguments_are_named_under_spawn(monkeypatch):
    import threading

    with pytest.raises(SpawnError, match=r"^argument 1 \(lock\) cannot be sent to spawned workers"):
        check_arguments_can_be_sent((1, threading.Lock()), {})
    with pytest.raises(SpawnError, match=r"^callback \(function\) cannot be sent"):
        check_arguments_can_be_sent((), {"callback": lambda: 0})
    check_arguments_can_be_sent((1, "a"), {"lr": 0.1})
    monkeypatch.setattr(spawn_module, "_launch", lambda *a: pytest.fail("a worker was started"))
    with pytest.raises(SpawnError, match="argument 0"):
        spawn(top_level, threading.Lock(), nprocs=2, start_method="spawn")
