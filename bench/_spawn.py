"""Start a benchmark function on N local CPU ranks (gloo over loopback) for side-by-side timing."""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)


def spawn(fn: Callable, world_size: int, *args) -> None:
    """Run `fn(*args)` on `world_size` ranks with torchrun's variables set; one thread each."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)


def in_process_group(fn: Callable, *args) -> None:
    """Join the gloo group (from the spawned rank's environment), run `fn(*args)`, leave cleanly."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        fn(*args)
    finally:
        dist.barrier()  # see TORCH-CPU-FACTS: a barrier before destroy avoids aborts at exit
        dist.destroy_process_group()
