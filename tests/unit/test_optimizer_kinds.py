"""Which optimizers step on slices and which get whole tensors, in which layout: the classification,
the declarations, the refusals and the owners' balance (no process group)."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.strategies.optimizers import optimizer_kinds
from phalanx.strategies.plan import presets
from phalanx.strategies.optimizers.optimizer_kinds import Route, StepKind, classify, route
from phalanx.strategies.optimizers.whole_tensor_step import balanced_owners


def _plan(name: str, world: int = 2, tp: int = 1, pp: int = 1, **kw):
    return presets.build(name, presets.asking(tp=tp, pp=pp), world_size=world, local_world_size=world, **kw)


@pytest.mark.parametrize(
    "name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD", "Adadelta", "Rprop"]
)
def test_torchs_elementwise_optimizers_keep_the_sliced_paths(name):
    found = classify(getattr(torch.optim, name))
    assert found.kind is StepKind.ELEMENTWISE and found.declared
    for layout in ("zero1", "zero2", "zero3"):
        assert route(found.kind, _plan(layout)) is Route.SLICES
    assert route(found.kind, _plan("ddp", tp=2)) is Route.SLICES
    assert route(found.kind, _plan("ddp")) is Route.AS_GIVEN


@pytest.mark.parametrize("name", ["Muon", "Adafactor"])
def test_muon_and_adafactor_get_whole_tensors_wherever_tensors_are_split(name):
    found = classify(getattr(torch.optim, name))
    assert found.kind is StepKind.WHOLE_TENSOR and found.declared
    for plan in (
        _plan("zero1"),
        _plan("zero2"),
        _plan("zero3"),
        _plan("hsdp", 4),
        _plan("ddp", tp=2),
        _plan("zero3", 4, tp=2),
        _plan("ddp"),
    ):  # ddp: each matrix on one replica, not on every one
        assert route(found.kind, plan) is Route.WHOLE_ON_OWNER, plan.describe()
    for plan in (_plan("ddp", pp=2), _plan("single", 1)):  # one holder per parameter already
        assert route(found.kind, plan) is Route.AS_GIVEN, plan.describe()
    # an optimizer phalanx only guessed at keeps torch's way among replicas (its step may read more)
    assert route(found.kind, _plan("ddp"), declared=False) is Route.AS_GIVEN


def test_an_unknown_optimizer_is_whole_tensor_and_undeclared_until_declared():
    class Mine(torch.optim.Optimizer):
        pass

    class MySlicedAdam(torch.optim.Adam):  # a subclass may read more than its parent: unknown too
        pass

    class Declared(torch.optim.Optimizer):
        phalanx_elementwise = True

    class Child(Declared):
        pass

    assert classify(Mine) == classify(Mine)  # noqa: PLR0124 - deterministic
    assert classify(Mine).kind is StepKind.WHOLE_TENSOR and not classify(Mine).declared
    assert not classify(MySlicedAdam).declared
    assert classify(Declared).kind is StepKind.ELEMENTWISE and classify(Child).declared
    phalanx.declare_optimizer(Mine, elementwise=False)
    assert classify(Mine).kind is StepKind.WHOLE_TENSOR and classify(Mine).declared
    phalanx.declare_optimizer(MySlicedAdam, elementwise=True)
    assert classify(MySlicedAdam).kind is StepKind.ELEMENTWISE
    with pytest.raises(ValueError, match="torch.optim.Optimizer subclass"):
        phalanx.declare_optimizer(int, elementwise=True)


def test_the_undeclared_warning_names_the_class_and_phalanx_parity():
    class Lamb(torch.optim.Optimizer):
        pass

    text = optimizer_kinds.undeclared_warning(Lamb.__new__(Lamb), _plan("zero3").describe())
    assert "Lamb" in text and "`phalanx parity`" in text and "declare_optimizer(Lamb" in text and "zero3" in text


def test_what_cannot_be_made_equal_is_refused_with_the_optimizer_layout_and_fix():
    with pytest.raises(ValueError, match=r"LBFGS reads every parameter.*zero3: dp_shard 2.*HINT: use strategy ddp"):
        route(StepKind.WHOLE_MODEL, _plan("zero3"), "LBFGS")
    with pytest.raises(ValueError, match=r"pp 2"):
        route(StepKind.WHOLE_MODEL, _plan("ddp", pp=2), "LBFGS")
    assert route(StepKind.WHOLE_MODEL, _plan("ddp"), "LBFGS") is Route.AS_GIVEN
    with pytest.raises(ValueError, match=r"LBFGS calls the closure.*cp 2.*HINT: use strategy ddp without cp"):
        route(
            StepKind.WHOLE_MODEL, presets.build("ddp", presets.asking(cp=2), world_size=2, local_world_size=2), "LBFGS"
        )
    with pytest.raises(ValueError, match=r"Muon reads whole tensors.*cpu_offload.*HINT: turn cpu_offload off"):
        route(StepKind.WHOLE_TENSOR, _plan("zero3", cpu_offload=True), "Muon")


def test_owners_are_balanced_by_size_and_the_same_on_every_rank():
    sizes = [2048, 1024, 1024, 1024, 1024, 2048] * 2 + [10, 5]
    owners = balanced_owners(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert abs(load[0] - load[1]) <= 5 and owners == balanced_owners(list(sizes), 2)
    big = balanced_owners([100, 1, 1, 1, 1], 4)  # one big tensor: alone on its rank, the rest spread
    assert big[0] not in big[1:] and len(set(big[1:])) == 3


def test_an_optimizer_that_cannot_be_rebuilt_on_the_owners_is_refused_at_prepare():
    from phalanx.strategies.optimizers.sharded_optimizer import constructor_defaults
    from phalanx.strategies.optimizers.whole_tensor_step import build

    class NeedsWidth(torch.optim.Optimizer):  # a constructor argument kept outside its defaults
        def __init__(self, params, width):
            super().__init__(params, {"lr": 0.1})
            self.width = width

    opt = NeedsWidth([torch.nn.Parameter(torch.zeros(3, 3))], width=3)
    with pytest.raises(
        ValueError,
        match=r"zero3: dp_shard 2.*rebuilds it on each owner as NeedsWidth\(param_groups, "
        r"\*\*defaults\); that failed:.*HINT: keep NeedsWidth's constructor arguments",
    ):
        build(opt, None, _plan("zero3"), constructor_defaults)
