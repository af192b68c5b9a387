"""Run on every rank by the StatefulDataLoader test: save mid-epoch, resume in a fresh loader."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from phalanx import Phalanx


def _prepared(directory: str, num_workers: int):
    px = Phalanx(seed=1, checkpoint_dir=directory)
    loader = StatefulDataLoader(TensorDataset(torch.arange(32)), batch_size=2, shuffle=True, num_workers=num_workers)
    return px, px.prepare(loader)


def save_and_resume(directory: str, num_workers: int) -> dict:
    """Epoch 0 whole, epoch 1 up to batch 3 then save; the rest read on, and read again after resume."""
    px, loader = _prepared(directory, num_workers)
    loader_class = type(loader.loader).__name__
    epoch0 = [idx.tolist() for (idx,) in loader]
    it = iter(loader)
    before = [next(it)[0].tolist() for _ in range(3)]
    px.save_state()
    rest = [idx.tolist() for (idx,) in it] + [[i for i in idx.tolist()] for (idx,) in loader]

    resumed_px, resumed = _prepared(directory, num_workers)
    assert resumed_px.load_state() is True
    again = [idx.tolist() for (idx,) in resumed] + [idx.tolist() for (idx,) in resumed]
    saved_state = px._checkpointer.rank_objects[0].state_dict()
    return {
        "epoch0": epoch0,
        "before": before,
        "rest": rest,
        "again": again,
        "class": loader_class,
        "saved_keys": sorted(saved_state),
        "len": len(loader),
    }
