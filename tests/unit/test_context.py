import pytest
import torch

from phalanx.runtime.context import DistContext
from phalanx.strategies.plan import presets


def test_no_launcher_variables_is_a_world_of_one():
    ctx = DistContext.from_env({})
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_distributed) == (0, 0, 1, False)
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"


def test_reads_torchrun_variables():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    ctx = DistContext.from_env(env)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size, ctx.node_rank) == (3, 1, 4, 2, 1)
    assert not ctx.is_main_process and not ctx.is_local_main_process


def test_rank_outside_world_names_the_launcher():
    with pytest.raises(ValueError, match=r"RANK=2 is outside WORLD_SIZE=2.*phalanx run"):
        DistContext.from_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_non_integer_variable_is_named():
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two' is not an integer"):
        DistContext.from_env({"WORLD_SIZE": "two"})


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown strategy 'zer0'; valid strategies: .*ddp"):
        presets.canonical("zer0")


def test_auto_and_ddp_in_a_world_of_one_run_single_device():
    assert presets.build("auto", presets.asking(), world_size=1, local_world_size=1).preset == "single"
    assert presets.build("ddp", presets.asking(), world_size=1, local_world_size=1).preset == "single"
    assert presets.canonical("auto") == "auto"  # decided at prepare, from the model size
