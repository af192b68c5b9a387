"""`ep` as a setting and a degree of the plan: one schema row (flag, variable, YAML, Phalanx()), taken
from the data-parallel x cp ranks (no process added), refused up front where it does not divide them,
and at prepare (in one process, no group) for a model ep cannot lay out: each message with the
numbers, the degrees that fit and a HINT."""

from __future__ import annotations

import pytest

from phalanx import config
from phalanx.strategies.plan import job_plan, presets, settings_check
from phalanx.strategies.expert_parallel import ep_plan
from tests.dist.ep_workloads import make_model


def build(name: str, world: int, ep: int, **degrees: int):
    return presets.build(name, presets.asking(ep=ep, **degrees), world_size=world, local_world_size=world)


def test_ep_is_one_row_read_from_every_source(tmp_path):
    row = config.BY_NAME["ep"]
    assert (row.flag, row.env, row.default) == ("--ep", "PHALANX_EP", 1)
    assert presets.asking(ep=2).ep == 2  # Phalanx(ep=2)
    assert config.resolve(config.from_env({"PHALANX_EP": "4"}), warn=False).config.ep == 4
    (tmp_path / "run.yaml").write_text("ep: 2\n")
    assert config.resolve(config.from_yaml(tmp_path / "run.yaml"), warn=False).config.ep == 2


def test_ep_takes_its_ranks_from_the_data_parallel_ranks():
    plan = build("ddp", 4, 2)
    assert plan.world_size == 4 and plan.degrees()["dp_replicate"] == 4  # no process added
    assert (plan.ep, plan.ep_replicate) == (2, 2) and "experts over ep 2" in plan.describe()
    assert build("zero3", 4, 4).ep_replicate == 1
    assert build("ddp", 4, 2, cp=2).ep == 2  # the cp ranks count: gradient ranks = dp x cp
    assert build("ddp", 1, 4).ep == 1  # a world of one runs the model as it is
    given = job_plan.inputs("ddp", presets.asking(ep=2), world_size=4, local_world_size=4)
    assert given["ep"] == 2  # a worker asking another ep never adopts the launcher's plan


def test_strategy_auto_keeps_ep_when_it_decides():
    # auto's replicas-or-shards decision dropped ep: `phalanx run --ep 2` ran plain ddp, every expert on every rank
    for name in presets.AUTO_CHOOSES:
        assert presets.decided(build("ddp", 4, 2), name).ep == 2, name


def test_ep_that_does_not_divide_the_data_parallel_ranks_is_refused_up_front():
    with pytest.raises(ValueError) as error:
        build("ddp", 4, 3)
    assert "ep=3 does not divide the 4 data-parallel x cp ranks" in str(error.value)
    assert "HINT: choose ep among 2, 4" in str(error.value)
    with pytest.raises(ValueError) as error:
        build("ddp", 4, 4, tp=2)
    assert "the 2 data-parallel x cp ranks" in str(error.value) and "choose ep among 2" in str(error.value)
    # the settings check of a world of one checks the smallest layout ep fits in: nothing refused
    resolved = config.resolve(config.from_kwargs({"ep": 4, "strategy": "ddp"}), warn=False)
    plan = presets.build("ddp", resolved.config, world_size=1, local_world_size=1)
    assert settings_check.checked_plan(resolved, plan).ep == 4


def test_a_model_ep_cannot_lay_out_is_refused_with_the_numbers():
    plan = build("ddp", 4, 4)
    with pytest.raises(ValueError) as error:
        ep_plan.find(make_model("dense"), ep_plan.model_plan(make_model("dense"), None), plan)
    text = str(error.value)
    assert "LlamaForCausalLM has no mixture-of-experts layer" in text and "declares no base_model_ep_plan" in text
    assert "HINT: use ep=1" in text
    six = make_model("mixtral", experts=6)
    with pytest.raises(ValueError) as error:
        ep_plan.find(six, ep_plan.model_plan(six, None), plan)
    text = str(error.value)
    assert "hold 6 experts each (model.layers.0.mlp.experts), which 4 expert-parallel ranks" in text
    assert "HINT: choose ep among 2 (dividing both the 6 experts and the 4 data-parallel x cp ranks)" in text


def test_the_models_own_plan_or_the_users_names_the_experts():
    model = make_model("qwen3_moe")
    found = ep_plan.find(model, ep_plan.model_plan(model, None), build("ddp", 2, 2))
    assert [(e.name, e.params, e.num_experts) for e in found] == [
        (f"model.layers.{i}.mlp.experts", ("gate_up_proj", "down_proj"), 4) for i in range(2)
    ]
    gpt = make_model("gpt_oss")
    found = ep_plan.find(gpt, ep_plan.model_plan(gpt, None), build("ddp", 2, 2))
    assert found[0].params == ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    user = {"model.layers.0.mlp.experts": "ep_dispatch_experts", "model.layers.0.mlp.experts.down_proj": "grouped_gemm"}
    found = ep_plan.find(model, ep_plan.model_plan(model, user), build("ddp", 2, 2))
    assert [(e.name, e.params) for e in found] == [("model.layers.0.mlp.experts", ("down_proj",))]
    with pytest.raises(ValueError, match="style\\(s\\) \\['colwise'\\]"):
        ep_plan.find(model, {"model.layers.0.mlp.experts": "colwise"}, build("ddp", 2, 2))


def test_a_capacity_factor_is_read_once_checked_and_kept_out_of_the_patterns():
    from phalanx.strategies.expert_parallel import capacity
    from phalanx.strategies.options import StrategyOptions

    assert StrategyOptions.from_dict({"capacity_factor": 1.25}).capacity_factor == 1.25
    assert capacity.factor(None, None, "ddp") is None  # the default: nothing dropped
    assert capacity.factor(1.25, None, "ddp") == capacity.factor(None, {"capacity_factor": 1.25}, "ddp") == 1.25
    with pytest.raises(ValueError, match="capacity_factor is given twice, 1.25 in strategy_options and 2 in"):
        capacity.factor(1.25, {"capacity_factor": 2}, "ddp")
    for bad in (0, -1.0, True, "1.25", float("inf")):
        with pytest.raises(ValueError, match="is not a positive number. HINT"):
            capacity.factor(bad, None, "ddp")
    model = make_model("qwen3_moe")
    assert ep_plan.model_plan(model, {"capacity_factor": 1.25}) == dict(model.config.base_model_ep_plan)
    user = {"model.layers.0.mlp.experts": "ep_dispatch_experts", "capacity_factor": 1.25}
    assert ep_plan.model_plan(model, user) == {"model.layers.0.mlp.experts": "ep_dispatch_experts"}


def test_phalanx_plan_ep_shows_expert_and_other_bytes_per_rank():
    import argparse

    import torch

    from phalanx.model import memory
    from phalanx.strategies.expert_parallel import plan_report as experts

    with torch.device("meta"):
        model = make_model("qwen3_moe")
    sizes = memory.model_sizes(model)
    args = argparse.Namespace(ep=2, tp=1, pp=1, cp=1, world_size=4, nproc_per_node=None)
    text = experts.report(args, model, sizes, "adamw", memory.format_bytes)
    # 2 layers x (gate_up [4, 32, 32] + down [4, 32, 16]) fp32 = 49152 parameter bytes; x4 with grads and AdamW
    assert "ep 2 of the 4 data-parallel ranks (2 MoE layer(s) x 4 experts)" in text
    assert "experts: 96.0 KiB under ep 2 (192.0 KiB under ddp, 48.0 KiB under zero3)" in text
    assert experts.report(argparse.Namespace(ep=1), model, sizes, "adamw", memory.format_bytes) == ""
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 data-parallel"):
        experts.report(argparse.Namespace(**{**vars(args), "ep": 3}), model, sizes, "adamw", memory.format_bytes)


def test_layouts_ep_is_not_composed_with_are_refused_before_anything_is_split():
    import torch

    from phalanx.strategies.expert_parallel import ExpertParallel
    from phalanx.strategies.layout import Layout

    with torch.device("meta"):
        meta = make_model("qwen3_moe")
    with pytest.raises(
        ValueError, match="on the meta device .* HINT: under ep, build the model outside px.init_module"
    ):
        ExpertParallel(meta, Layout(build("zero3", 2, 2), None), torch.device("cpu"))
    with pytest.raises(  # ep x tp and ep x pp are composed (tests/dist/test_expert_parallel.py), all three not yet
        ValueError,
        match=r"ep=2 \(.*pp 2.*tp 2.*\) with tp and pp together: .* Qwen3MoeForCausalLM's experts cannot be laid out\. "
        r"HINT: use ep with tp \(pp=1\) or ep with pp \(tp=1\)",
    ):
        ExpertParallel(make_model("qwen3_moe"), Layout(build("ddp", 8, 2, tp=2, pp=2), None), torch.device("cpu"))
