"""ZeRO-3 for models bigger than one device, on 2 CPU ranks: a 1.6 GB model built on the meta
device never materialised whole, weights drawn as a normal construction draws them, px.load_model
reading only each rank's slices, activation checkpointing and compile equal to the plain run."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


# ---- a 1.6 GB model under zero3 --------------------------------------------------------------------
def _quiet(tmp_path_factory) -> dict[str, str]:
    return {"PHALANX_RUN_DIR": str(tmp_path_factory.mktemp("run"))}  # phalanx's logs outside the repo


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return run_ranks("tests.dist.zero3_workloads:big_meta", 2, timeout=600, env=_quiet(tmp_path_factory))


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_peak_memory_after_prepare_is_half_the_model_plus_one_module(big):
    """Each rank's peak RSS after prepare: the baseline (torch with FSDP2 loaded, measured in the
    same process before building the model), its half of the model, and one module's full tensors
    drawn at a time plus their slice (the shards alone are exactly half the model's bytes)."""
    for rank in big:
        run = rank["init_module"]
        assert run["model_bytes"] >= 1.5e9
        grown = run["peak_after_prepare"] - run["baseline"]
        assert grown < run["model_bytes"] / 2 + 2 * run["largest_module_bytes"], (grown, run["model_bytes"])
        assert grown < 0.6 * run["model_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_initial_shards_are_reproducible_and_look_like_a_normal_init(big):
    bound = 1 / math.sqrt(4096)  # nn.Linear(4096, 4096): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    for rank in big:
        first, second = rank["init_module"]["stats"], rank["meta"]["stats"]
        assert first == second  # same seed, init_module and a plain meta context: the same shards
        for name, s in first.items():
            assert s["finite"] and s["zeros"] <= s["numel"] * 1e-6, (name, s)
            assert -bound <= s["min"] < -0.99 * bound and 0.99 * bound < s["max"] <= bound, (name, s)
            if name.endswith("weight"):  # 8M values: std of U(-b, b) within 0.5%, mean near 0
                assert abs(s["std"] - bound / math.sqrt(3)) < 0.005 * bound / math.sqrt(3), (name, s)
                assert abs(s["mean"]) < 0.01 * bound, (name, s)
    r0, r1 = big[0]["init_module"]["stats"], big[1]["init_module"]["stats"]
    assert all(r0[n]["head"] != r1[n]["head"] for n in r0)  # the ranks hold different slices


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_steps_run_on_the_meta_built_model(big):
    losses = big[0]["meta"]["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert losses == big[1]["meta"]["losses"]  # reduced: the same on both ranks


# ---- small models: init equal to normal construction, load_model, activation checkpointing --------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return run_ranks(
        "tests.dist.zero3_workloads:both",
        2,
        args=(str(tmp_path_factory.mktemp("load")),),
        timeout=300,
        env=_quiet(tmp_path_factory),
    )


@pytest.mark.timeout(400)
def test_meta_init_equals_a_normal_construction_under_zero3_and_ddp(small):
    load = small[0]["load"]
    for strategy in ("zero3", "ddp"):
        for how in ("init_module", "meta"):
            assert load[f"meta_equal_{strategy}_{how}"] is True, (strategy, how)
    assert small[1]["load"]["meta_equal_ddp_meta"] is True


def test_load_model_safetensors_zero3_each_rank_reads_only_its_slices(small):
    assert small[0]["load"]["st_zero3_equal"] is True
    for rank, result in enumerate(small):
        load = result["load"]
        assert load["st_zero3_bytes_read"] == load["st_zero3_local_bytes"] == load["file_bytes"] // 2
        reads = dict(load["st_zero3_reads"])
        assert "whole" not in reads.values()
        # dim 0 halved: rank 0 reads the first rows of every tensor, rank 1 the last, nothing else
        assert reads["blocks.0.fc1.weight"] == (((0, 16), (0, 16)) if rank == 0 else ((16, 32), (0, 16)))
        assert reads["head.weight"] == (((0, 2), (0, 16)) if rank == 0 else ((2, 4), (0, 16)))


def test_load_model_safetensors_and_torch_file_equal_the_file(small):
    for result in small:
        assert result["load"]["st_ddp_equal"] is True  # ddp: every rank, plain load
    assert small[0]["load"]["pt_zero3_equal"] is True  # torch file: rank 0 reads, broadcast to rank 1
    assert small[0]["load"]["st_zero3_ac_equal"] is True  # checkpoint wrappers change no names


def test_load_model_bad_keys_load_nothing_and_name_every_problem(small):
    expected = (
        "nothing loaded; missing in the checkpoint (1): head.bias; unexpected in the checkpoint (1): "
        "extra.weight; shape mismatch (1): blocks.0.fc1.weight: checkpoint (5, 5) vs model (32, 16). "
        "HINT: fix the checkpoint or the model, or pass strict=False to load the keys that match."
    )
    for result in small:
        load = result["load"]
        assert load["bad_st_error"].endswith(expected) and load["bad_dict_error"].endswith(expected)
        assert load["bad_loaded_nothing"] is True
        assert load["lenient"] == {
            "missing": ["head.bias"],
            "unexpected": ["extra.weight"],
            "mismatched": ["blocks.0.fc1.weight: checkpoint (5, 5) vs model (32, 16)"],
            "loaded": 25,
        }
    assert small[0]["load"]["lenient_fc2_loaded"] is True and small[0]["load"]["lenient_head_bias_kept"] is True


def test_activation_checkpointing_gives_the_same_gradients_under_ddp_and_zero3(small):
    for result in small:
        for strategy in ("ddp", "zero3"):
            run = result["ac"][strategy]
            for variant in ("ckpt", "by_class"):
                assert sorted(run[variant]) == sorted(run["plain"])
                for name, grad in run["plain"].items():
                    torch.testing.assert_close(run[variant][name], grad, rtol=1e-6, atol=1e-7)


# ---- compile -------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_compiled_losses_equal_eager_over_20_steps_under_ddp_and_zero3(tmp_path_factory):
    ranks = run_ranks("tests.dist.zero3_workloads:compiled_losses", 2, timeout=560, env=_quiet(tmp_path_factory))
    for result in ranks:
        for strategy in ("ddp", "zero3"):
            eager, compiled = result[f"{strategy}_eager"], result[f"{strategy}_compiled"]
            assert len(compiled["losses"]) == 20
            torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-4, atol=1e-5)
            assert eager["forward_types"] == ["method"] * 4
            assert all(t != "method" for t in compiled["forward_types"])
        # dynamo really compiled frames (the blocks' forwards), and only in the compiled runs
        assert ranks[0]["ddp_eager"]["frames_compiled"] == 0
        assert ranks[0]["ddp_compiled"]["frames_compiled"] >= 1
        assert ranks[0]["zero3_eager"]["frames_compiled"] == ranks[0]["ddp_compiled"]["frames_compiled"]
        assert ranks[0]["zero3_compiled"]["frames_compiled"] > ranks[0]["zero3_eager"]["frames_compiled"]
