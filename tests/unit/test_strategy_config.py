"""Pure parts of the strategies: names, DeepSpeed mapping, settings precedence, precision names."""

from __future__ import annotations

import json
import warnings

import pytest

from phalanx.runtime.context import DistContext
from phalanx import config
from phalanx.strategies.plan import presets
from phalanx.config import deepspeed as deepspeed_config
from phalanx.strategies.choice import choose
from phalanx.strategies.options import StrategyOptions
from phalanx.loop.precision import check_name

TWO = DistContext(world_size=2, local_world_size=2)


def test_unknown_strategy_lists_every_valid_name():
    with pytest.raises(ValueError) as e:
        presets.canonical("zero4")
    assert str(e.value) == (
        "unknown strategy 'zero4'; valid strategies: auto, ddp, dp, fsdp, hsdp, single, zero1, zero2, zero3"
    )


def build(name, world_size=1):
    return presets.build(name, presets.asking(), world_size=world_size, local_world_size=world_size).preset


def test_names_resolve_and_fsdp_is_zero3():
    assert [presets.canonical(n) for n in ("ddp", "zero1", "zero2", "zero3", "FSDP", "auto")] == [
        "ddp",
        "zero1",
        "zero2",
        "zero3",
        "zero3",
        "auto",
    ]
    assert [build(n, 2) for n in ("ddp", "zero1", "zero2", "zero3", "FSDP")] == [
        "ddp",
        "zero1",
        "zero2",
        "zero3",
        "zero3",
    ]
    assert {build(n) for n in ("ddp", "zero1", "zero2", "zero3", "fsdp", "auto")} == {"single"}
    assert build("dp") == "dp"


def test_dp_refuses_several_processes():
    with pytest.raises(ValueError, match="world_size=2. HINT: use strategy='ddp'"):
        build("dp", 2)


def test_strategy_options_refuse_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown strategy option\(s\) \['cpu_ofload'\]"):
        StrategyOptions.from_dict({"cpu_ofload": True})


def test_mixed_precision_names():
    assert [check_name(n) for n in ("no", "bf16", "FP16", "bfloat16", "none")] == ["no", "bf16", "fp16", "bf16", "no"]
    with pytest.raises(ValueError, match="valid values: no, bf16, fp16"):
        check_name("fp8")


FULL = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu"},
        "overlap_comm": True,
    },
    "optimizer": {"type": "AdamW"},
    "steps_per_print": 10,
}


def test_deepspeed_config_maps_every_supported_key_and_warns_once_about_the_rest(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(FULL))
    with pytest.warns(UserWarning) as record:
        ds = deepspeed_config.load(path)
    assert len(record) == 1
    assert str(record[0].message).endswith(
        "NOT applied: optimizer, steps_per_print, zero_optimization.offload_param.pin_memory, "
        "zero_optimization.overlap_comm"
    )
    assert (
        ds.strategy,
        ds.cpu_offload,
        ds.mixed_precision,
        ds.grad_accum_steps,
        ds.gradient_clipping,
        ds.micro_batch_size,
        ds.train_batch_size,
    ) == ("zero3", True, "bf16", 4, 1.0, 4, 32)
    ds.check_world(2)
    with pytest.raises(ValueError, match=r"4 x gradient_accumulation_steps=4 x world_size=4 = 64"):
        ds.check_world(4)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=4 but the DataLoader has batch_size=8"):
        ds.check_loader(8)


@pytest.mark.parametrize("stage,name", [(0, "ddp"), (1, "zero1"), (2, "zero2"), (3, "zero3")])
def test_deepspeed_stages(stage, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unsupported here: no warning at all
        assert deepspeed_config.load({"zero_optimization": {"stage": stage}}).strategy == name


def test_deepspeed_offload_outside_stage3_and_nvme_are_reported_not_applied():
    ds = deepspeed_config.load(
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "nvme"},
            }
        },
        warn=False,
    )
    assert ds.cpu_offload is None
    assert ds.unsupported == [
        "zero_optimization.offload_optimizer (stage 2 (phalanx offloads under stage 3 only))",
        "zero_optimization.offload_param (device 'nvme')",
    ]


def test_deepspeed_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="enables both bf16 and fp16"):
        deepspeed_config.load({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"zero_optimization.stage=4; valid stages: 0, 1, 2, 3"):
        deepspeed_config.load({"zero_optimization": {"stage": 4}})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        deepspeed_config.load(tmp_path / "bad.json")


def test_hf_auto_values_mean_not_set():
    ds = deepspeed_config.load(
        {"gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto"}
    )
    assert (ds.grad_accum_steps, ds.mixed_precision, ds.micro_batch_size) == (None, None, None)


def choice_for(env=None, **kwargs):
    resolved = config.resolve(config.from_env(env or {}), config.from_kwargs(kwargs))
    return choose(resolved)


def test_settings_precedence_and_conflicts():
    ds = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}
    s = choice_for(deepspeed=ds)
    assert (s.strategy, s.grad_accum_steps, s.options.mixed_precision) == ("zero2", 2, "no")
    with pytest.raises(
        config.ConfigError, match="strategy='zero3' was given by Phalanx\\(\\) but the DeepSpeed config says 'zero2'"
    ):
        choice_for(strategy="zero3", deepspeed=ds)
    env = {"PHALANX_STRATEGY": "zero1", "PHALANX_GRAD_ACCUM_STEPS": "3", "PHALANX_MIXED_PRECISION": "bf16"}
    s = choice_for(env)
    assert (s.strategy, s.grad_accum_steps, s.options.mixed_precision) == ("zero1", 3, "bf16")
    assert choice_for(env, strategy="ddp", grad_accum_steps=1).strategy == "ddp"  # argument beats env


def test_settings_from_env_deepspeed_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    s = choice_for({"PHALANX_DEEPSPEED_CONFIG": str(path)})
    assert (s.strategy, s.options.cpu_offload) == ("zero3", True)
