"""Lockstep safety without a process group: watchdog verdicts, settings, debug checks, world of one."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx import Phalanx
from phalanx.runtime import debug
from phalanx.runtime.step_tracker import StepTracker
from phalanx.runtime.verdict import PeerView, judge

NOW = 100.0


def view(step: int, phase: str, moved_ago: float = 10.0, beat_ago: float = 0.5) -> PeerView:
    return PeerView(record=(1, 1, step, phase), beat_at=NOW - beat_ago, moved_at=NOW - moved_ago)


def test_no_verdict_while_any_rank_moves():
    assert judge([view(3, "backward"), view(3, "step", moved_ago=1.0)], NOW, 5.0, me=0) is None


def test_no_verdict_when_every_rank_is_at_the_same_place():
    # A long evaluation or compile on every rank is work, not a rank out of step.
    assert judge([view(3, "forward"), view(3, "forward")], NOW, 5.0, me=0) is None


def test_every_rank_stuck_in_a_communicating_phase_beyond_the_collective_timeout_is_reported():
    stuck = [view(3, "backward", moved_ago=40.0), view(3, "backward", moved_ago=41.0)]
    assert judge(stuck, NOW, 5.0, me=0, stuck_after=45.0) is None  # not yet
    verdict = judge(stuck, NOW, 5.0, me=0, stuck_after=35.0)
    assert verdict.culprits == [0, 1] and verdict.dead == []
    assert verdict.headline.startswith(
        "phalanx watchdog: every rank has been in phase 'backward' at step 3 for 40.0 s, "
        "longer than a collective may take (collective timeout + watchdog timeout = 35 s)"
    )
    assert verdict.lines == [
        "  rank 0: step 3, phase 'backward'  <-- stuck",
        "  rank 1: step 3, phase 'backward'  <-- stuck",
    ]
    # Long work that is not communication (data, saving, main_process_first) is never judged so.
    for phase in ("data", "save_state", "main_process_first", "step", "forward"):
        assert judge([view(3, phase, moved_ago=400.0)] * 2, NOW, 5.0, me=0, stuck_after=35.0) is None
    # Nor the first step, where torch.compile may compile the backward for minutes.
    assert judge([view(0, "backward", moved_ago=400.0)] * 2, NOW, 5.0, me=0, stuck_after=35.0) is None


def test_rank_in_the_script_while_others_wait_is_the_culprit():
    verdict = judge([view(3, "backward"), view(3, "step")], NOW, 5.0, me=0)
    assert verdict.culprits == [1] and verdict.dead == []
    assert verdict.headline.startswith(
        "phalanx watchdog: rank 1 stalled at step 3 (phase 'step': in the training script, between phalanx calls)"
    )
    assert verdict.lines == [
        "  rank 0: step 3, phase 'backward' (waiting)",
        "  rank 1: step 3, phase 'step'  <-- stalled",
    ]


def test_silent_rank_is_reported_dead_even_at_the_same_place():
    verdict = judge([view(3, "backward"), view(3, "backward", beat_ago=7.0)], NOW, 5.0, me=0)
    assert verdict.culprits == [1] and verdict.dead == [1]
    assert "rank 1 died (no heartbeat) at step 3, phase 'backward'" in verdict.headline
    assert verdict.lines[1].endswith("<-- died: no heartbeat for 7.0 s")


def test_rank_that_left_its_loop_is_named_with_a_hint():
    verdict = judge([view(4, "exit"), view(5, "backward"), view(5, "backward")], NOW, 5.0, me=1)
    assert verdict.culprits == [0]
    assert "rank 0 left its training loop after step 4" in verdict.headline
    assert "px.uneven_inputs(model)" in verdict.headline


def test_ranks_that_all_left_their_scripts_are_never_judged():
    # Exit hooks (observe's last table) wait on each other for seconds after the loop: all ranks in
    # 'exit', at different steps, one past its last heartbeat (its thread ended first), is no stall.
    leaving = [view(4, "exit", moved_ago=60.0), view(5, "exit mid-pass", moved_ago=60.0, beat_ago=30.0)]
    assert judge(leaving, NOW, 5.0, me=0) is None
    assert judge(leaving[:1] * 2, NOW, 5.0, me=1, stuck_after=10.0) is None


def test_all_waiting_at_different_steps_blames_the_rank_behind():
    verdict = judge([view(7, "reduce"), view(6, "backward")], NOW, 5.0, me=0)
    assert verdict.culprits == [1]
    assert "rank 1 stalled at step 6, phase 'backward', behind the others" in verdict.headline


def test_no_verdict_before_every_rank_has_reported():
    assert judge([view(3, "backward"), PeerView()], NOW, 5.0, me=0) is None


def test_debug_describes_nested_batches():
    batch = {"x": torch.zeros(2, 3), "y": [torch.zeros(2, dtype=torch.int64)], "meta": "keep"}
    assert debug.describe(batch) == [((2, 3), "float32"), ((2,), "int64")]


def test_progress_phases():
    progress = StepTracker()
    assert (progress.step, progress.phase) == (-1, "start")
    progress.next_step()
    with progress.during("backward"):
        assert progress.phase == "backward"
    assert (progress.step, progress.phase, progress.ticks) == (0, "step", 3)
    with pytest.raises(RuntimeError):
        with progress.during("reduce"):
            raise RuntimeError("a failed collective")
    assert progress.phase == "step"  # a caught failure leaves the rank back in its script
    with progress.busy_with("saving"):
        assert (progress.busy, progress.phase) == (1, "saving")
    assert (progress.busy, progress.phase) == (0, "step")


class Numbers(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_world_of_one_shards_an_iterable_over_workers_without_repeats(monkeypatch):
    monkeypatch.delenv("PHALANX_WATCHDOG_TIMEOUT", raising=False)
    px = Phalanx()
    assert px.watchdog is None  # nothing to watch in a world of one
    loader = px.prepare(DataLoader(Numbers(), batch_size=2, num_workers=2))
    seen = sorted(x for batch in loader for x in batch.tolist())
    assert seen == list(range(10))


def test_world_of_one_uneven_inputs_is_a_pass_through():
    px = Phalanx()
    model = px.prepare(torch.nn.Linear(1, 1))
    with px.uneven_inputs(model) as uneven:
        assert uneven.method == "none"
        assert list(uneven.iter([1, 2, 3])) == [1, 2, 3]
    with pytest.raises(ValueError, match="method must be one of"):
        px.uneven_inputs(model, method="maybe")


def test_presplit_and_stream_positions_resume_per_rank():
    px = Phalanx()
    for make in (
        lambda: DataLoader(torch.arange(10), batch_size=2),  # pre-split map-style
        lambda: DataLoader(Numbers(), batch_size=2),
    ):  # a stream
        loader = px.prepare(make(), shard=False)
        it = iter(loader)
        taken = [next(it).tolist() for _ in range(3)]
        state = loader.state_dict()
        assert (state["unit"], state["consumed"], state["epoch"]) == ("batches_per_rank", 3, 0)
        resumed = px.prepare(make(), shard=False)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == [[6, 7], [8, 9]]
        assert taken == [[0, 1], [2, 3], [4, 5]]
        assert resumed.state_dict()["epoch"] == 1  # the pass is complete: the next one starts afresh


def test_rank_that_exited_with_batches_unread_is_not_said_to_have_run_out_of_data():
    """A rank that called sys.exit(0) mid-epoch was diagnosed as "its data ran out first"."""
    verdict = judge([view(4, "backward"), view(2, "exit mid-pass")], NOW, 5.0, me=0)
    assert verdict.culprits == [1]
    assert (
        "rank 1 exited after step 2 with batches of its prepared loader still unread (a break, return or "
        "sys.exit in the script?)"
    ) in verdict.headline
    assert "data ran out" not in verdict.headline
    assert verdict.lines[1].endswith("<-- left its training loop")


def test_rank_that_left_after_as_many_batches_as_the_others_is_not_said_to_have_run_out_of_data():
    """LBFGS whose line search read each rank's own loss: the ranks made different numbers of closure
    calls (backwards) in one step, and the watchdog blamed the data of a loop whose loader was prepared."""
    verdict = judge([view(2, "backward"), view(2, "exit")], NOW, 5.0, me=0)
    assert verdict.culprits == [1]
    assert "rank 1 left its training loop after step 2, the same batch count as the others" in verdict.headline
    assert "rank 0 in phase 'backward'" in verdict.headline and "closure" in verdict.headline
    assert "data ran out" not in verdict.headline
