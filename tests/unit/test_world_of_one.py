"""`python train.py` with no launcher: no process group, every verb still works."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx


def test_plain_process_needs_no_launcher():
    px = Phalanx()
    assert dist.get_world_size() == 1 and dist.get_rank() == 0  # a group of its one rank (DistributedSampler's)
    assert (px.rank, px.world_size, px.is_main_process, px.strategy_name) == (0, 1, True, "single")
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(px.reduce(t, "sum"), t) and torch.equal(px.gather(t), t)
    px.wait_for_everyone()


def test_prepare_returns_objects_in_the_order_given():
    px = Phalanx()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    out = px.prepare(loader, opt, model)
    assert out[1] is opt and isinstance(out[2], torch.nn.Linear) and len(out[0]) == 2
    assert px.prepare(model) is model


def test_gather_for_metrics_outside_a_loader_is_plain_gather():
    px = Phalanx()
    assert px.gather_for_metrics(torch.arange(3)).tolist() == [0, 1, 2]
    assert px.gather_for_metrics(["a", "b"]) == ["a", "b"]


def test_print_in_a_world_of_one_prints(capsys):
    """(Printing on the main process only, with 2 ranks: tests/dist/test_sharding.py::test_print_only_on_main.)"""
    Phalanx().print("hello")
    assert capsys.readouterr().out == "hello\n"


def test_reduce_rejects_unknown_reduction():
    import pytest

    with pytest.raises(ValueError, match="reduction must be one of"):
        Phalanx().reduce(torch.ones(1), "avg")
