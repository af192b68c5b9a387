"""Every strategy on 2 CPU ranks equals a single-process run on the same global batches.

ONE 2-rank launch runs the whole matrix (plain, accumulation, clipping, bf16, DeepSpeed config,
auto); the single-process references run in the test process. Each test asserts on one slice.
"""

from __future__ import annotations

import pytest
import torch

from phalanx.model import memory
from tests.dist import strategy_workloads as w
from tests.dist.harness import run_ranks
from tests.plan_reference import by_preset

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SHARDED = ("zero2", "zero3", "offload", "hsdp")
ALL = ("ddp", "zero1", "zero2", "zero3", "offload", "hsdp")
CLIP = 0.05  # small enough that clipping binds on every step
DS_CONFIG = {
    "zero_optimization": {"stage": 3},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": CLIP,
    "train_micro_batch_size_per_gpu": 4,
    "train_batch_size": 16,
    "bf16": {"enabled": False},
}


def _kwargs(name: str) -> dict:
    if name == "hsdp":  # 2 replicas of 1 shard: the replicate dimension's all-reduce (4 ranks: test_hsdp.py)
        return {"strategy": "hsdp", "options": {"replicate_size": 2, "shard_size": 1}}
    return {"strategy": "zero3", "options": {"cpu_offload": True}} if name == "offload" else {"strategy": name}


def _cases(tmp: str) -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for name in ALL:
        cases[f"plain-{name}"] = _kwargs(name)
        cases[f"accum-{name}"] = {**_kwargs(name), "accum": 2}
        cases[f"clip-{name}"] = {**_kwargs(name), "clip": CLIP}
    for name in ("ddp", "zero3"):
        cases[f"bf16-{name}"] = {"strategy": name, "mixed_precision": "bf16", "epochs": 4}
    for name in ("ddp", "zero3"):
        cases[f"fp16-{name}"] = {"strategy": name, "mixed_precision": "fp16", "epochs": 4, "clip": 1.0}
    cases["deepspeed"] = {"deepspeed": DS_CONFIG}
    cases["checkpoint-zero3-accum"] = {"strategy": "zero3", "accum": 2, "epochs": 1, "checkpoint": f"{tmp}/ckpt"}
    cases["auto-small-budget"] = {"strategy": "auto", "options": {"memory_budget_bytes": 1000}, "epochs": 1}
    cases["auto-large-budget"] = {"strategy": "auto", "options": {"memory_budget_bytes": 10**9}, "epochs": 1}
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("strategies"))
    ranks = run_ranks("tests.dist.strategy_workloads:matrix", 2, args=(_cases(tmp),), timeout=280)
    return {"rank0": ranks[0], "rank1": ranks[1]}


@pytest.fixture(scope="module")
def refs() -> dict:
    return {
        "plain": w.train(),
        "accum2": w.train(accum=2),  # 1 process x k=2 == 2 processes x k=1
        "accum4": w.train(accum=4),  # 1 process x k=4 == 2 processes x k=2
        "clip": w.train(clip=CLIP),
        "clip-accum4": w.train(accum=4, clip=CLIP),
    }


def _assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", ALL)
def test_strategy_equals_single_process(runs, refs, name):
    r0 = runs["rank0"][f"plain-{name}"]
    assert r0["strategy"] == ("zero3" if name == "offload" else name)
    assert refs["plain"]["strategy"] == "single"
    assert len(r0["losses"]) == len(refs["plain"]["losses"]) == 8
    _assert_state_equal(r0["state"], refs["plain"]["state"])
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(refs["plain"]["losses"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ALL)
def test_two_processes_k1_equal_one_process_k2(runs, refs, name):
    _assert_state_equal(runs["rank0"][f"plain-{name}"]["state"], refs["accum2"]["state"])


@pytest.mark.parametrize("name", ALL)
def test_accumulation_on_two_ranks_equals_one_process_k4(runs, refs, name):
    r0, r1 = runs["rank0"][f"accum-{name}"], runs["rank1"][f"accum-{name}"]
    assert len(r0["losses"]) == 16  # micro-steps
    _assert_state_equal(r0["state"], refs["accum4"]["state"])
    # the sync really was skipped on the 8 non-final micro-steps
    assert len(r0["unsynced"]) == len(r1["unsynced"]) == 8
    if name in SHARDED:  # no reduce-scatter: FSDP keeps the unsharded sum, no sharded grad yet
        assert r0["unsynced"] == r1["unsynced"] == [None] * 8
        # ... except the embedding looked up where its rows live: its small exchange runs every
        # micro-step, so it holds its sharded gradient (an unsharded one would cost V x D memory)
        table = ["embed.weight"] if name in ("zero2", "zero3") else []  # (not with offload or hsdp)
        assert r0["exchanged"] == r1["exchanged"] == [table] * 8
    else:  # no all-reduce: each rank holds its own local gradients
        assert all(a != b for a, b in zip(r0["unsynced"], r1["unsynced"]))


@pytest.mark.parametrize("name", ALL)
def test_clip_norm_is_the_global_norm(runs, refs, name):
    r0, r1 = runs["rank0"][f"clip-{name}"], runs["rank1"][f"clip-{name}"]
    assert len(r0["norms"]) == 8 and r0["norms"] == r1["norms"]
    assert min(r0["norms"]) > CLIP  # clipping really happened on every step
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(refs["clip"]["norms"]), rtol=1e-5, atol=1e-6)
    _assert_state_equal(r0["state"], refs["clip"]["state"])


def test_replicated_strategies_give_full_weights_on_every_rank_sharded_on_main_only(runs):
    for name in ALL:
        r1 = runs["rank1"][f"plain-{name}"]["state"]
        if name in SHARDED:
            assert r1 == {}, name
        else:
            _assert_state_equal(r1, runs["rank0"][f"plain-{name}"]["state"])


def test_param_groups_and_hyperparameters_survive_prepare(runs):
    for name in ALL:
        groups = runs["rank0"][f"plain-{name}"]["param_groups"]
        assert [g["weight_decay"] for g in groups] == [0.01, 0.0], name
        assert all(g["lr"] == 1e-2 for g in groups), name


def test_zero3_holds_half_the_parameter_and_optimizer_bytes_of_ddp(runs):
    ddp = runs["rank0"]["plain-ddp"]["bytes"]
    for rank in ("rank0", "rank1"):
        z3 = runs[rank]["plain-zero3"]["bytes"]
        ratio = (z3["params"] + z3["optimizer"]) / (ddp["params"] + ddp["optimizer"])
        assert 0.47 < ratio < 0.53, (rank, ratio)


def test_plan_matches_the_bytes_measured_on_real_ranks(runs):
    table = by_preset(memory.model_sizes(w.make_model()), world_size=2, optimizer="adamw")
    for name in ("ddp", "zero1", "zero2", "zero3"):
        for rank in (0, 1):
            held = runs[f"rank{rank}"][f"plain-{name}"]["bytes"]
            planned = table[name][rank]
            for part in ("params", "grads", "optimizer"):
                assert abs(getattr(planned, part) - held[part]) <= 0.1 * held[part], (name, rank, part)
    offload = runs["rank0"]["plain-offload"]["bytes"]
    assert (
        abs(table["zero3-offload"][0].host - (offload["params"] + offload["grads"] + offload["optimizer"]))
        <= 0.1 * table["zero3-offload"][0].host
    )


@pytest.mark.parametrize("name", ("ddp", "zero3"))
def test_bf16_trains(runs, name):
    losses = runs["rank0"][f"bf16-{name}"]["losses"]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.1, (first, last)
    assert runs["rank0"][f"bf16-{name}"]["strategy"] == name


@pytest.mark.parametrize("name", ("ddp", "zero3"))
def test_fp16_with_gradient_scaler_trains_and_ranks_agree_on_skipped_steps(runs, name):
    r0, r1 = runs["rank0"][f"fp16-{name}"], runs["rank1"][f"fp16-{name}"]
    # the scaler starts at 2**16: the first step overflows, is skipped on BOTH ranks, scale shrinks
    assert r0["norms"][0] != r0["norms"][0] and r1["norms"][0] != r1["norms"][0]  # NaN
    assert r0["norms"][1:] == r1["norms"][1:] and all(n == n for n in r0["norms"][1:])
    losses = r0["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.1, losses


def test_deepspeed_config_maps_to_zero3_with_accumulation_and_clipping(runs, refs):
    r0 = runs["rank0"]["deepspeed"]
    assert r0["strategy"] == "zero3" and len(r0["losses"]) == 16
    # gradient_clipping clips inside optimizer.step(): the same weights as clipping by hand
    _assert_state_equal(r0["state"], refs["clip-accum4"]["state"])


def test_auto_picks_zero3_over_budget_and_ddp_within(runs):
    assert runs["rank0"]["auto-small-budget"]["strategy"] == "zero3"
    assert runs["rank0"]["auto-large-budget"]["strategy"] == "ddp"


def test_checkpoint_round_trip_under_zero3_with_accumulation(runs):
    for rank in ("rank0", "rank1"):
        restored = runs[rank]["checkpoint-zero3-accum"]["restored"]
        assert restored["global_step"] == (4, 4)  # 8 micro-steps, k=2: 4 real optimizer steps
        assert restored["optimizer_equal"], rank
        assert restored["manifest_strategy"] == "zero3"
    assert runs["rank0"]["checkpoint-zero3-accum"]["restored"]["weights_equal"]
