"""Step anatomy and the straggler judge, without processes: a fake clock and synthetic steps."""

from __future__ import annotations

import random

import pytest

from phalanx.observe.anatomy import StepAnatomy, rank_order
from phalanx.observe.straggler import StragglerWatch, assess
from phalanx.runtime.step_tracker import Phase, StepTracker


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_tracker_s_phase_changes_become_each_step_s_phase_times():
    clock = Clock()
    tracker = StepTracker()
    tracker.anatomy = anatomy = StepAnatomy(clock)
    for _ in range(3):  # what a prepared loader, a watched model and optimizer, and px.busy call
        tracker.enter(Phase.DATA)
        tracker.before_batch()
        clock.now += 0.010  # waiting for the batch
        tracker.next_step()
        tracker.enter(Phase.FORWARD)
        clock.now += 0.020
        tracker.enter(Phase.STEP)
        clock.now += 0.001
        with tracker.during(Phase.BACKWARD):
            clock.now += 0.030
        with tracker.busy_with("tokenize"):
            clock.now += 0.004
        tracker.enter(Phase.OPTIMIZER)
        clock.now += 0.002
        tracker.enter(Phase.STEP)
    tracker.enter(Phase.DATA)
    tracker.before_batch()  # ends the third step; the loader is exhausted
    tracker.before_batch()  # the next epoch's first request: no step in between, none counted
    assert [step for step, _ in anatomy.steps] == [0, 1, 2]
    for _, times in anatomy.steps:
        assert times == pytest.approx(
            {"data": 0.010, "forward": 0.020, "other": 0.001, "backward": 0.030, "tokenize": 0.004, "optimizer": 0.002}
        )
    assert anatomy.num_steps == 3 and anatomy.totals["backward"] == pytest.approx(0.090)


def test_columns_are_in_step_order_with_named_phases_beside_the_script_s_own_code():
    assert rank_order({"optimizer", "backward", "data", "zz", "aa", "forward", "collectives"}) == [
        "data",
        "forward",
        "aa",
        "zz",
        "backward",
        "collectives",
        "optimizer",
    ]


def _steps(num_steps, planted=None, ranks=2, seed=0, extra=0.03):
    rnd = random.Random(seed)
    out = [dict() for _ in range(ranks)]
    for s in range(num_steps):
        base = {"data": 0.001, "forward": 0.010, "other": 0.002, "backward": 0.020, "optimizer": 0.003}
        times = [{k: v * (1 + 0.5 * rnd.random()) for k, v in base.items()} for _ in range(ranks)]
        if planted:
            for t in times:
                t.setdefault(planted, 0.0)
        if planted:  # rank 1 is late by `extra` in `planted`; the others wait for it in backward's all-reduce
            times[1][planted] += extra
            for r in range(ranks):
                if r != 1:
                    times[r]["backward"] += extra
        for r in range(ranks):
            out[r][s] = times[r]
    return out


@pytest.mark.parametrize("phase", ["data", "forward", "other", "tokenize"])
@pytest.mark.parametrize("ranks", [2, 5])
def test_the_late_rank_is_named_with_the_phase_it_lost_time_in(phase, ranks):
    seen = assess(_steps(100, phase, ranks))
    assert seen.rank == 1 and seen.phase == phase and seen.share == 1.0
    assert seen.excess_ms == pytest.approx(30, abs=3)
    lines = StragglerWatch().update(seen, [("vm", r) for r in range(ranks)])
    assert lines == [
        f"straggler: rank 1 (host vm, local rank 1) slowest in 100 % of the last 100 steps: "
        f"+{round(seen.excess_ms)} ms/step in {phase}"
    ]


def test_noise_names_nobody_and_the_end_of_a_straggler_is_said():
    watch = StragglerWatch()
    where = [("vm", 0), ("vm", 1)]
    for seed in range(20):
        assert watch.update(assess(_steps(100, seed=seed)), where) == []
    assert watch.update(assess(_steps(100, "data")), where)[0].startswith("straggler: rank 1")
    assert watch.update(assess(_steps(100, "data", seed=1)), where) == []  # still the same one: said once
    ended = watch.update(assess(_steps(100, seed=2)), where)
    assert len(ended) == 1 and ended[0].startswith("straggler ended: rank 1") and watch.current is None


def test_a_few_slow_steps_or_a_small_lead_name_nobody():
    assert assess(_steps(20, "data")) is None  # too few steps to judge
    seen = assess(_steps(100, "data", extra=0.001))  # 1 ms: always last, but by too little to matter
    assert StragglerWatch().update(seen, [("vm", 0), ("vm", 1)]) == []
    assert assess([_steps(100)[0]]) is None  # one rank


class FakeEvent:
    """A CUDA event's interface on a fake clock; `done` says whether the device has passed it."""

    clock = Clock()
    done = True

    def record(self):
        self.at = FakeEvent.clock.now

    def query(self):
        return FakeEvent.done

    def elapsed_time(self, end):
        return 1000 * (end.at - self.at)


def test_on_cuda_steps_are_read_from_events_once_the_device_has_passed_them():
    from phalanx.observe.anatomy import DeviceTimedAnatomy

    clock = FakeEvent.clock
    tracker = StepTracker()
    tracker.anatomy = anatomy = DeviceTimedAnatomy(FakeEvent)
    FakeEvent.done = False  # the device is still behind: nothing is read, nothing waits
    for _ in range(2):
        tracker.enter(Phase.DATA)
        tracker.before_batch()
        clock.now += 0.010
        tracker.next_step()
        tracker.enter(Phase.FORWARD)
        clock.now += 0.020
        with tracker.during(Phase.BACKWARD):
            clock.now += 0.030
    tracker.enter(Phase.DATA)
    tracker.before_batch()
    assert anatomy.num_steps == 0
    FakeEvent.done = True
    tracker.before_batch()  # the loader asks again (an epoch's end): the device has caught up
    assert [s for s, _ in anatomy.steps] == [0, 1]
    for _, times in anatomy.steps:
        assert times == pytest.approx({"data": 0.010, "forward": 0.020, "backward": 0.030, "other": 0.0})


def test_without_a_prepared_loader_each_optimizer_step_ends_a_step_and_backward_is_marked():
    """A loop that makes its batches itself: the anatomy counts optimizer steps (from 0, as a loader
    loop counts batches), the plain loss.backward() through a watched model is its own phase, and
    the tracker's own step (the watchdog's, preemption's) still counts prepared batches only."""
    import torch

    from phalanx.runtime.step_tracker import watch_module, watch_optimizer

    clock = Clock()
    tracker = StepTracker()
    tracker.anatomy = anatomy = StepAnatomy(clock)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch_module(tracker, model)
    watch_optimizer(tracker, optimizer)
    for _ in range(3):
        clock.now += 0.005  # making the batch in the loop
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [step for step, _ in anatomy.steps] == [0, 1, 2] and anatomy.step == 2 and tracker.step == -1
    assert anatomy.counts == "optimizer steps"
    assert all({"forward", "backward", "optimizer"} <= set(times) and "data" not in times for _, times in anatomy.steps)
    assert [times["other"] for _, times in anatomy.steps] == pytest.approx([0.005] * 3)  # the batch making


def test_evaluation_batches_are_not_steps_in_the_exit_table():
    """Issue 54: the end-of-run table counted evaluation batches as steps (126 for 100 steps)."""
    from phalanx.observe.exchange import Exchange

    clock = Clock()
    tracker = StepTracker()
    tracker.anatomy = anatomy = StepAnatomy(clock)
    for training in (True, True, False, False, False):  # 2 steps, then an evaluation pass of 3 batches
        tracker.enter(Phase.DATA)
        tracker.before_batch()
        tracker.next_step()
        tracker.enter(Phase.FORWARD)
        clock.now += 0.020
        if training:
            with tracker.during(Phase.BACKWARD):
                clock.now += 0.030
            tracker.enter(Phase.OPTIMIZER)
            clock.now += 0.010
        tracker.enter(Phase.STEP)
    tracker.enter(Phase.DATA)
    tracker.before_batch()
    assert (anatomy.num_steps, anatomy.eval_batches) == (2, 3)
    exchange = Exchange.__new__(Exchange)
    exchange._peers = [
        {"rank": 0, "host": "vm", "num_steps": 2, "eval_batches": 3, "totals": anatomy.totals},
        {"rank": 1, "host": "vm", "num_steps": 2, "eval_batches": 3, "totals": anatomy.totals},
    ]
    assert exchange.phase_table().splitlines() == [
        "step anatomy (ms per step):",
        "rank  host  steps  data  forward  other  backward  optimizer",
        "   0    vm      2   0.0     20.0    0.0      30.0       10.0",
        "   1    vm      2   0.0     20.0    0.0      30.0       10.0",
        "(not steps: 3 evaluation batches per rank, read with no backward or optimizer step)",
    ]
