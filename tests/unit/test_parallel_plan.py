"""The parallel plan: presets as points of it, what each layout uses, settings refused by name
where the layout would ignore them (every runtime setting x every preset), tensor-parallel plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx import config
from phalanx.config.names import Needs
from phalanx.launch import run_command
from phalanx.strategies import tensor_parallel
from phalanx.strategies.plan import job_plan, presets, settings_check
from tests.plan_reference import intended_plan
from phalanx.strategies.plan.parallel_plan import ParallelPlan, Sharding


def build(name, world=4, local=4, tp=1, pp=1, cp=1, **kw):
    return presets.build(name, presets.asking(tp=tp, pp=pp, cp=cp), world_size=world, local_world_size=local, **kw)


def test_presets_are_points_of_the_plan():
    assert build("ddp").degrees() == {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "cp": 1, "tp": 1}
    assert build("zero1").sharding is Sharding.OPTIMIZER and build("zero1").dp_replicate == 4
    assert build("zero3").degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}
    assert build("zero2").sharding is Sharding.GRADIENTS and not build("zero2").reshard_after_forward
    assert build("hsdp", local=2).degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1}
    assert build("zero3", tp=2).degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert build("hsdp", world=8, local=4, tp=2).degrees() == {
        "pp": 1,
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 1,
        "tp": 2,
    }
    assert build("fsdp").preset == "zero3"
    assert build("zero3", world=1, local=1).preset == "single"


def test_what_each_layout_uses():
    ddp, zero1, zero3, hsdp = build("ddp"), build("zero1"), build("zero3"), build("hsdp", local=2)
    assert ddp.uses_ddp and zero1.uses_ddp and not zero3.uses_ddp and not hsdp.uses_ddp
    assert zero3.uses_fsdp and hsdp.uses_fsdp and not ddp.uses_fsdp
    assert build("ddp", tp=2).uses_fsdp and not build("ddp", tp=2).uses_ddp  # TP composes with FSDP2
    assert build("ddp", world=2, tp=2).dp_size == 1 and not build("ddp", world=2, tp=2).uses_fsdp
    assert zero3.builds_on_meta and not ddp.builds_on_meta and build("ddp", tp=2).builds_on_meta
    assert zero1.shards_optimizer_only and not zero3.shards_optimizer_only
    assert zero3.has(Needs.ROW_SHARDED_EMBEDDINGS) and not hsdp.has(Needs.ROW_SHARDED_EMBEDDINGS)
    assert not build("zero3", tp=2).has(Needs.ROW_SHARDED_EMBEDDINGS)
    assert build("zero3", cpu_offload=True).cpu_offload and not build("ddp", cpu_offload=True).cpu_offload


def test_ranks_lie_tp_innermost_and_data_follows_the_data_parallel_dims():
    plan = build("zero3", world=8, local=8, tp=2)
    assert [plan.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plan.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "cp": 0, "tp": 1}
    hsdp = build("hsdp", world=8, local=4, tp=2)
    assert [hsdp.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert hsdp.describe() == "hsdp: dp_replicate 2 x dp_shard 2 x tp 2 (8 process(es))"


def test_a_plan_refuses_degrees_that_shard_nothing():
    with pytest.raises(ValueError, match="dp_shard=2 with sharding NONE"):
        ParallelPlan("ddp", dp_shard=2)
    with pytest.raises(ValueError, match="tp=0 must be a positive whole number"):
        ParallelPlan("ddp", tp=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "ddp", "world": 4, "tp": 3}, r"tp=3 does not divide the 4 processes. HINT: choose tp among 1, 2, 4"),
        (
            {"name": "dp", "world": 1, "local": 1, "tp": 2},
            r"strategy 'dp' runs one process, and tp=2 needs 2 processes",
        ),
        (
            {"name": "hsdp", "world": 6, "local": 3, "tp": 2},
            r"hsdp with tp=2: each node's 3 processes do not split into tensor-parallel groups.*among 1, 3",
        ),
        ({"name": "zero4"}, r"unknown strategy 'zero4'; valid strategies: auto, ddp, dp, fsdp"),
    ],
)
def test_layouts_that_cannot_be_built_are_refused_with_the_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


# A value that asks for something, for every runtime setting whose need is not ALWAYS; a new row
# with a need must be added here, which is the point: its applicability is then walked below.
ASKING = {
    "find_unused_parameters": True,
    "static_graph": True,
    "bucket_cap_mb": 10,
    "gradient_as_bucket_view": False,
    "comm_hook": "fp16",
    "powersgd_rank": 2,
    "powersgd_start_iter": 5,
    "memory_budget": "1GB",
    "embedding_exchange": "params",
    "zero1_gather": "persistent",
    "zero1_grads": "reduce_scatter",
    "sequence_parallel": True,
    "pp_schedule": "GPipe",
    "pp_microbatches": 4,
    "pp_split": ["layers.2"],
    "tp_plan": {"layers.*.q": "colwise"},
}
PRESET_NAMES = ["ddp", "zero1", "zero2", "zero3", "hsdp", "dp", "auto"]
REFUSED_UNDER_PP = {"static_graph"}  # DDP per pipeline stage computes wrong gradients with it (settings_check)


def test_every_setting_that_needs_something_from_the_layout_is_walked():
    needing = {s.name for s in config.RUNTIME if s.needs is not Needs.ALWAYS}
    assert needing == set(ASKING)


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("name", sorted(ASKING))
def test_every_setting_x_preset_is_applied_refused_or_warned_never_ignored(name, preset, tp, pp):
    if preset == "dp" and tp * pp > 1:
        return  # dp with tp or pp is no layout at all (refused above)
    resolved = config.resolve(config.from_kwargs({"strategy": preset, "tp": tp, "pp": pp, name: ASKING[name]}))
    world = 1 if preset == "dp" else 4
    plan = intended_plan(resolved, world, 2 if preset == "hsdp" else world)
    need = config.BY_NAME[name].needs
    if plan is None:  # auto: undecided; what it may choose is checked once it has chosen
        met = (
            (need is not Needs.TENSOR_PARALLEL or tp > 1)
            and (need is not Needs.PIPELINE or pp > 1)
            and need is not Needs.SHARDED_OPTIMIZER
        )  # auto picks ddp or zero3, never zero1
    else:
        met = plan.has(need)
    if met and pp > 1 and name in REFUSED_UNDER_PP and (plan is None or plan.uses_ddp):
        with pytest.raises(config.ConfigError, match=rf"^{name}={ASKING[name]!r} with pp={pp}: "):
            settings_check.check(resolved, plan)
    elif met:
        assert settings_check.check(resolved, plan) == []
    elif need is Needs.AUTO:
        warnings = settings_check.check(resolved, plan)
        assert len(warnings) == 1 and warnings[0].startswith(f"{name}=") and "read by strategy auto only" in warnings[0]
    else:
        with pytest.raises(config.ConfigError, match=rf"^{name}="):
            settings_check.check(resolved, plan)


def test_ddp_options_under_hsdp_are_refused_not_silently_ignored():
    # hsdp was missing from the old WITHOUT_DDP list and FSDP2 never read DDP's options
    resolved = config.resolve(config.from_kwargs({"strategy": "hsdp", "find_unused_parameters": True}))
    with pytest.raises(
        config.ConfigError,
        match=r"find_unused_parameters=True \(from Phalanx\(\)\): DistributedDataParallel "
        r"options, but strategy 'hsdp' uses FSDP2, which has no DDP",
    ):
        settings_check.check(resolved, intended_plan(resolved, 4, 2))
    with pytest.raises(ValueError, match="strategy 'hsdp' uses FSDP2"):
        from phalanx import Phalanx

        Phalanx(strategy="hsdp", find_unused_parameters=True)


def test_ddp_options_with_tensor_parallel_name_why():
    resolved = config.resolve(config.from_kwargs({"strategy": "ddp", "tp": 2, "comm_hook": "fp16"}))
    with pytest.raises(
        config.ConfigError,
        match=r"strategy 'ddp' with tp=2 uses FSDP2 \(tensor parallel composes with "
        r"FSDP2\), which has no DDP\. HINT: use strategy ddp or zero1 with tp=1",
    ):
        settings_check.check(resolved, intended_plan(resolved, 4, 4))


def test_tp_plan_reads_from_every_source():
    kind = config.BY_NAME["tp_plan"].kind
    assert kind.from_text('{"layers.*.q": "colwise", "head": "colwise_rep"}') == {
        "layers.*.q": "colwise",
        "head": "colwise_gather_output",
    }
    assert kind.from_text("layers.*.q=colwise,layers.*.o=rowwise") == {"layers.*.q": "colwise", "layers.*.o": "rowwise"}
    assert kind.from_object({"a": "ROWWISE"}) == {"a": "rowwise"}
    with pytest.raises(ValueError, match=r"'a': unknown style 'diagonal'; choose one of colwise, rowwise"):
        kind.from_object({"a": "diagonal"})
    resolved = config.resolve(config.from_kwargs({"tp_plan": {"layers.*.q": "colwise"}}))
    assert config.worker_env(resolved)["PHALANX_TP_PLAN"] == '{"layers.*.q": "colwise"}'  # it travels to workers


def test_tp_plan_with_tp_1_is_refused_not_ignored():
    """tp_plan was silently ignored while tp was 1 (its schema row named no need)."""
    resolved = config.resolve(config.from_kwargs({"strategy": "ddp", "tp_plan": {"layers.*.q": "colwise"}}))
    with pytest.raises(
        config.ConfigError,
        match=r"tp_plan=\{'layers.\*.q': 'colwise'\} \(from Phalanx\(\)\): a "
        r"tensor-parallel setting, but tp is 1\. HINT: set tp > 1",
    ):
        settings_check.check(resolved, intended_plan(resolved, 1, 1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2))
        self.norm = nn.LayerNorm(8)


def test_tensor_parallel_plans_match_module_names():
    assert tensor_parallel.match(Net(), {"blocks.*.0": "colwise", "blocks.1.1": "rowwise"}) == {
        "blocks.0.0": "colwise",
        "blocks.1.0": "colwise",
        "blocks.1.1": "rowwise",
    }
    with pytest.raises(ValueError, match=r"tp > 1, but Net has no tensor-parallel plan"):
        tensor_parallel.model_plan(Net(), None)


def test_a_transformers_model_brings_its_own_plan():
    from tests.dist.tp_workloads import tiny_llama

    plan = tensor_parallel.model_plan(tiny_llama(), None)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"


def test_one_tensor_parallel_rank_holds_the_split_layers_narrowed():
    with torch.device("meta"):
        net = Net()
    tensor_parallel.shrink_to_one_rank(
        net, {"blocks.*.0": "colwise", "blocks.*.1": "rowwise"}, build("ddp", world=2, local=2, tp=2)
    )
    assert net.blocks[0][0].weight.shape == (8, 8) and net.blocks[0][0].bias.shape == (8,)
    assert net.blocks[0][1].weight.shape == (8, 8) and net.blocks[0][1].bias.shape == (8,)
    assert net.blocks[0](torch.empty(3, 8, device="meta")).shape == (3, 8)  # a rank's part computes end to end
    with pytest.raises(ValueError, match=r"tp=3: layer 'blocks.0.0' \(Linear\) has 16 rows to split"):
        with torch.device("meta"):
            tensor_parallel.shrink_to_one_rank(Net(), {"blocks.*.0": "colwise"}, build("ddp", world=3, local=3, tp=3))


def test_launcher_refuses_tp_that_does_not_divide_the_processes(tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    parser = run_command_parser()
    args = parser.parse_args(["--nproc-per-node", "2", "--tp", "3", str(script)])
    assert run_command.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx run: error: tp=3 does not divide the 2 processes. HINT: choose tp among 1, 2")
    spec = run_command.spec_from_args(
        parser.parse_args(
            [
                "--nproc-per-node",
                "3",
                "--nnodes",
                "2",
                "--master-addr",
                "10.0.0.1",
                "--master-port",
                "29555",
                "--tp",
                "2",
                "--strategy",
                "zero3",
                str(script),
            ]
        )
    )
    run_command.check_layout(spec, 3)  # 6 processes: fine, but each tp group spans two nodes
    assert "phalanx run: warning: tp=2 does not divide the 3 processes of a node" in capsys.readouterr().err
    spec = run_command.spec_from_args(
        parser.parse_args(["--nproc-per-node", "2", "--tp", "2", "--strategy", "dp", str(script)])
    )
    with pytest.raises(run_command.LaunchError, match="strategy 'dp' runs one process, and tp=2"):
        run_command.check_layout(spec, 2)


def run_command_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="phalanx run")
    run_command.configure(parser)
    return parser


def test_cp_is_a_mesh_dim_between_data_parallel_and_tp():
    plan = build("ddp", world=8, local=8, tp=2, cp=2)
    assert plan.degrees() == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 2}
    assert plan.dp_size == 2 and plan.grad_size == 4 and plan.uses_fsdp  # tp composes with FSDP2
    assert [plan.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # a cp group reads the same rows
    assert [plan.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    alone = build("ddp", world=2, local=2, cp=2)
    assert alone.dp_size == 1 and alone.grad_size == 2 and alone.uses_ddp  # gradients averaged over cp
    assert build("zero3", world=4, local=4, cp=2).degrees()["dp_shard"] == 2
    assert build("ddp", world=1, local=1, cp=2).cp == 1  # a world of one runs the whole sequence
    hsdp = build("hsdp", world=8, local=4, cp=2)  # a node: 2 shards x cp 2; 2 nodes: 2 replicas
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.cp) == (2, 2, 2)


@pytest.mark.parametrize(
    "name, kw, match",
    [
        ("ddp", dict(world=6, cp=4), r"cp=4 does not divide the 6 processes. HINT: choose cp among 1, 2, 3, 6"),
        ("ddp", dict(world=4, cp=2, tp=4), r"cp=2 x tp=4 does not divide the 4 processes"),
        ("ddp", dict(world=4, cp=2, pp=2), r"cp=2 with pp=2: context parallel is not composed with pipeline"),
        ("dp", dict(world=1, local=1, cp=2), r"strategy 'dp' runs one process, and cp=2"),
        ("hsdp", dict(world=4, local=2, cp=4), r"hsdp with cp=4: each node's 2 processes do not split"),
    ],
)
def test_cp_layouts_refused_with_the_fix(name, kw, match):
    with pytest.raises(ValueError, match=match):
        build(name, **kw)


def test_one_tensor_parallel_rank_holds_its_part_of_each_fused_expert_weight():
    from tests.dist.moe_tp_workloads import make_model

    with torch.device("meta"):
        moe = make_model("qwen3_moe")  # gate_up [4, 32, 32] packed_colwise, down [4, 32, 16] rowwise
    chosen = tensor_parallel.shrink_to_one_rank(moe, None, build("ddp", world=2, local=2, tp=2))
    experts = moe.model.layers[0].mlp.experts
    assert chosen["model.layers.0.mlp.experts"] == "moe_tp_experts"
    assert experts.gate_up_proj.shape == (4, 16, 32) and experts.down_proj.shape == (4, 32, 8)
    assert not any(name.endswith("mlp.gate_proj") for name in chosen)  # the plan's dense-MLP rows: no such layer


def test_the_launcher_hands_each_membership_of_an_elastic_job_its_plan(tmp_path):
    # before: one plan, of the largest size; a membership of 1 or 2 nodes rebuilt its own, silently
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    spec = run_command.spec_from_args(
        run_command_parser().parse_args(
            [
                "--nproc-per-node",
                "2",
                "--nnodes",
                "1:3",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "10.0.0.1:29555",
                "--strategy",
                "zero3",
                str(script),
            ]
        )
    )
    handed = run_command.check_layout(spec, 2)
    for world in (2, 4, 6):
        given = job_plan.inputs("zero3", spec.settings.config, world_size=world, local_world_size=2)
        assert job_plan.received(given, handed).dp_shard == world


def test_sequence_parallel_under_pp_x_tp_is_refused_before_the_model_is_cut():
    from types import SimpleNamespace

    from phalanx.loop.precision import Precision
    from phalanx.strategies.options import StrategyOptions
    from phalanx.strategies.parallelize import parallelize

    layout = SimpleNamespace(plan=build("ddp", world=4, local=4, tp=2, pp=2))
    options = StrategyOptions(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel with pp=2 x tp=2: .* HINT: leave sequence_parallel off"):
        parallelize(
            nn.Linear(2, 2), layout, options=options, precision=Precision(), device=torch.device("cpu"), backend="gloo"
        )
