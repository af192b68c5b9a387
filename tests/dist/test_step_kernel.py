"""ddp, zero1, zero2 and zero3 step a script's AdamW (nothing set) with torch's fused CPU kernel,
FSDP2's uneven and empty shards included, and train to one process's weights."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_an_unset_adamw_steps_fused_and_trains_as_one_process(strategy):
    ranks = run_ranks("tests.dist.step_kernel_workloads:train", 2, args=(strategy,), timeout=240)
    reference = ranks[0]["reference"]
    for rank in ranks:
        assert rank["kernels"] == [(True, None)], rank["kernels"]
    state = ranks[0]["state"]  # px.get_state_dict: the full weights on the main process
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=2e-4, atol=1e-6, msg=key)
