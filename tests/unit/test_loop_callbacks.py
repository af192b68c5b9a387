"""Parity, the throughput meter and whatever else hooks into the loop subscribe to one callback
list (loop/callbacks.py); the facade calls the list, never tests for a feature."""

from __future__ import annotations

from pathlib import Path

from phalanx.loop.callbacks import LoopCallbacks

FACADE = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "facade.py"


def test_the_list_calls_the_hooks_each_callback_has_in_order():
    calls = []

    class Records:
        def on_backward(self, loss, num_items):
            calls.append(("records", loss, num_items))

        def loader_scale(self, split_batches):
            return 1 if split_batches else 4

    class Counts:
        def on_backward(self, loss, num_items):
            calls.append(("counts", loss, num_items))

    callbacks = LoopCallbacks(Records(), None, Counts())  # None: a feature that is off
    callbacks.notify("on_backward", 2.0, 3)
    callbacks.notify("before_step", 1, [])  # nobody has it: nothing happens
    assert calls == [("records", 2.0, 3), ("counts", 2.0, 3)]
    assert (callbacks.loader_scale(False), callbacks.loader_scale(True), LoopCallbacks().loader_scale(False)) == (
        4,
        1,
        1,
    )


def test_the_facade_holds_no_feature_tests_for_what_hooks_into_the_loop():
    source = FACADE.read_text()
    assert "_parity" not in source and "throughput.commit" not in source
