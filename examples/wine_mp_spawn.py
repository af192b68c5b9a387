"""The tutorial's mp.spawn wine script, with `Phalanx()` added after its own init_process_group.

    python examples/wine_mp_spawn.py --epochs 20

Scripts that start their ranks themselves (torch.multiprocessing.spawn here) and initialise the
process group keep doing so: Phalanx() adopts that group (rank, world size, backend) and behaves
as under `phalanx run`: sharded loaders, the strategy's model wrapper, one print. No
DistributedSampler or DDP by hand.
"""

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.utils.data import DataLoader

from phalanx import Phalanx

from wine import SimpleNN, load_data  # noqa: E402 - the same model and data as examples/wine.py


def ddp_setup(rank: int, world_size: int, port: int) -> None:
    """The tutorial's setup, device-agnostic: NCCL on GPUs, gloo on CPUs."""
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)


def main(rank: int, world_size: int, port: int, epochs: int, batch_size: int) -> None:
    ddp_setup(rank, world_size, port)
    px = Phalanx()  # adopts the group above: px.world_size == world_size
    torch.manual_seed(0)
    train_set, _ = load_data()
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    model, optimizer, loader = px.prepare(model, optimizer, loader)
    for epoch in range(epochs):
        seen, total = 0, torch.zeros((), device=px.device)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            px.backward(loss)
            optimizer.step()
            total += loss.detach()
            seen += len(y)
        if epoch % 10 == 0 or epoch == epochs - 1:
            px.print(f"epoch {epoch}: loss {px.reduce(total / len(loader)).item():.4f}")
    counts = px.gather(torch.tensor([seen], device=px.device)).tolist()
    px.print(
        f"{px.world_size} ranks (strategy {px.strategy_name}) saw {counts} of {len(train_set)} "
        "training samples per epoch"
    )
    destroy_process_group()  # the script created the group, so the script ends it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    args = parser.parse_args()
    world_size = torch.cuda.device_count() or 2
    mp.spawn(main, args=(world_size, free_port(), args.epochs, args.batch_size), nprocs=world_size)
