"""Pipeline parallel as a dimension of the parallel plan: the pp settings on every surface, presets
with pp, what the settings alone show wrong refused before any worker starts (exit 2), a world of
one, the watchdog naming stages, and a meta model's stage initialised as one process would."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from phalanx import Phalanx, config
from phalanx.launch import run_command
from phalanx.model import meta_init
from phalanx.runtime.verdict import PeerView, judge
from phalanx.strategies.plan import presets, settings_check
from tests.plan_reference import intended_plan
from phalanx.strategies.options import StrategyOptions
from phalanx.strategies.plan.parallel_plan import Sharding
from phalanx.strategies.pipeline import layout, schedules
from tests.dist.tp_workloads import TinyLM


def build(name, world=4, local=4, tp=1, pp=1, **kw):
    return presets.build(name, presets.asking(tp=tp, pp=pp), world_size=world, local_world_size=local, **kw)


def check(**settings):
    resolved = config.resolve(config.from_kwargs(settings))
    return settings_check.check(resolved, intended_plan(resolved, 4, 4))


# ---- the settings ------------------------------------------------------------------------------
def test_pp_settings_read_from_every_surface():
    resolved = config.resolve(
        config.from_env(
            {
                "PHALANX_PP": "2",
                "PHALANX_PP_SCHEDULE": "gpipe",
                "PHALANX_PP_MICROBATCHES": "8",
                "PHALANX_PP_SPLIT": "layers.4",
            }
        )
    )
    cfg = resolved.config
    assert (cfg.pp, cfg.pp_schedule, cfg.pp_microbatches, cfg.pp_split) == (2, "GPipe", 8, ["layers.4"])
    assert (
        config.resolve(config.from_kwargs({"pp_schedule": "INTERLEAVED1F1B"})).config.pp_schedule == "Interleaved1F1B"
    )
    defaults = config.resolve().config
    assert (defaults.pp, defaults.pp_schedule, defaults.pp_microbatches, defaults.pp_split) == (1, "1F1B", None, None)
    with pytest.raises(config.ConfigError, match=r"pp_schedule.*'Zigzag'.*choose one of 1F1B, GPipe, Interleaved1F1B"):
        config.resolve(config.from_kwargs({"pp_schedule": "Zigzag"}))
    assert config.worker_env(config.resolve(config.from_kwargs({"pp": 2, "pp_split": ["layers.4"]}))) == {
        "PHALANX_PP": "2",
        "PHALANX_PP_SPLIT": "layers.4",
    }


def test_the_options_carry_the_pipeline_settings():
    from phalanx.strategies.choice import choose

    options = choose(
        config.resolve(
            config.from_kwargs({"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 6, "pp_split": ["layers.1"]})
        )
    ).options
    assert (options.pp_schedule, options.pp_microbatches, options.pp_split) == ("GPipe", 6, ["layers.1"])


# ---- presets with pp ------------------------------------------------------------------------------
def test_presets_compose_with_pp_and_data_follows_the_data_parallel_dims():
    assert build("ddp", pp=2).degrees() == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert build("zero3", pp=2).degrees() == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    assert build("zero1", pp=2).sharding is Sharding.OPTIMIZER
    assert build("ddp", world=8, local=8, pp=2, tp=2).degrees() == {
        "pp": 2,
        "dp_replicate": 2,
        "dp_shard": 1,
        "cp": 1,
        "tp": 2,
    }
    assert build("ddp", world=2, local=2, pp=2).degrees() == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 1,
        "cp": 1,
        "tp": 1,
    }
    plan = build("ddp", pp=2)
    assert [plan.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]  # pp outermost: ranks 0, 1 run stage 0
    assert [plan.coordinates(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    assert plan.uses_ddp and not build("zero3", pp=2).uses_ddp and build("zero3", pp=2).uses_fsdp
    assert not build("ddp", world=2, local=2, pp=2).uses_ddp  # stages only: nothing to replicate
    assert build("ddp", pp=2).builds_on_meta and build("ddp", pp=2).partial_gradients
    assert not build("zero3", pp=2).reshard_after_forward and build("zero3").reshard_after_forward
    assert build("zero3", pp=2).describe() == "zero3: pp 2 x dp_shard 2 (4 process(es))"


def test_hsdp_with_pp_shards_each_stage_within_a_node_and_replicates_across():
    # 2 nodes of 4, pp 2: a stage's 4 data-parallel ranks are one node's, sharded (no replica)
    assert build("hsdp", world=8, local=4, pp=2).degrees() == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 4,
        "cp": 1,
        "tp": 1,
    }
    # 4 nodes of 4, pp 2: each stage on 2 nodes, sharded within one, replicated across the two
    assert build("hsdp", world=16, local=4, pp=2).degrees() == {
        "pp": 2,
        "dp_replicate": 2,
        "dp_shard": 4,
        "cp": 1,
        "tp": 1,
    }
    assert build("hsdp", world=4, local=4, pp=2).degrees() == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 1,
        "tp": 1,
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"name": "ddp", "pp": 3},
            r"^pp=3 does not divide the 4 processes: each data-parallel replica needs pp = 3 of "
            r"them. HINT: choose pp among 1, 2, 4, or run a multiple of 3 processes",
        ),
        (
            {"name": "zero3", "world": 8, "local": 8, "pp": 3, "tp": 2},
            r"^pp=3 x tp=2 does not divide the 8 processes: each data-parallel replica needs pp x tp = 6 of them. HINT: "
            r"choose pp among 1, 2, 4 \(with tp=2\), or run a multiple of 6 processes",
        ),
        (
            {"name": "dp", "world": 1, "local": 1, "pp": 2},
            r"^strategy 'dp' runs one process, and pp=2 needs a process per pipeline stage. HINT: use strategy ddp",
        ),
    ],
)
def test_pp_layouts_that_cannot_be_built_are_refused_with_the_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


# ---- what the settings alone show wrong ---------------------------------------------------------
@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"pp": 2, "pp_microbatches": 1},
            r"^pp_microbatches=1 is smaller than pp=2: the pipeline would never fill. "
            r"HINT: set pp_microbatches to at least 2 \(default 2 x pp = 4\)",
        ),
        (
            {"pp": 2, "pp_schedule": "DualPipeV", "pp_microbatches": 2},
            r"^pp_schedule=DualPipeV needs pp_microbatches >= its 4 stages; got 2",
        ),
        (
            {"pp": 2, "pp_split": ["layers.1", "layers.2"]},
            r"^pp_split=\['layers.1', 'layers.2'\] names 2 cut point\(s\), which makes 3 stage\(s\), but pp=2 runs 2 "
            r"stage\(s\). HINT: name 1 module\(s\) to cut before",
        ),
        (
            {"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_split": ["layers.1"]},
            r"but pp=2 runs 4 stage\(s\), 2 per pipeline rank under pp_schedule=Interleaved1F1B. HINT: name 3",
        ),
        (
            {"pp": 2, "strategy": "ddp", "find_unused_parameters": False},
            r"^find_unused_parameters=False with pp=2: DistributedDataParallel over a pipeline stage must look for unused "
            r"parameters .* HINT: drop the setting",
        ),
        (
            {"pp": 2, "strategy": "ddp", "static_graph": True},
            r"^static_graph=True with pp=2: a pipeline stage's DDP does not run a static graph .* HINT: drop the setting",
        ),
        (
            {"pp_microbatches": 4},
            r"^pp_microbatches=4 \(from Phalanx\(\)\): a pipeline setting, but pp is 1. HINT: set "
            r"pp > 1 \(e.g. --pp 2\), or drop it",
        ),
        ({"pp": 2, "strategy": "dp"}, r"strategy 'dp' runs one process, and pp=2 needs a process per pipeline stage"),
    ],
)
def test_pipeline_settings_the_settings_alone_show_wrong_are_refused(settings, message):
    with pytest.raises(config.ConfigError, match=message):
        check(**settings)


def test_right_pipeline_settings_pass():
    assert (
        check(
            pp=2,
            strategy="ddp",
            find_unused_parameters=True,
            pp_schedule="gpipe",
            pp_microbatches=2,
            pp_split=["layers.1"],
        )
        == []
    )
    assert check(pp=2, strategy="zero3", pp_microbatches=8) == []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx run")
    run_command.configure(parser)
    return parser


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc-per-node", "4", "--pp", "3"], "phalanx run: error: pp=3 does not divide the 4 processes"),
        (["--nproc-per-node", "4", "--pp", "2", "--tp", "4"], "phalanx run: error: pp=2 x tp=4 does not divide the 4"),
        (
            ["--nproc-per-node", "2", "--pp", "2", "--pp-microbatches", "1"],
            "phalanx run: error: pp_microbatches=1 is smaller than pp=2",
        ),
        (
            ["--nproc-per-node", "2", "--pp", "2", "--strategy", "dp"],
            "phalanx run: error: strategy 'dp' runs one process, and pp=2 needs a process per pipeline stage",
        ),
        (
            ["--nproc-per-node", "2", "--pp-split", "layers.1"],
            "phalanx run: error: pp_split=['layers.1'] (from --pp-split): a pipeline setting, but pp is 1",
        ),
    ],
)
def test_phalanx_run_refuses_bad_pp_before_any_worker_starts(tmp_path, capsys, flags, message):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    assert run_command.main(_parser().parse_args([*flags, str(script)])) == 2
    assert capsys.readouterr().err.startswith(message)


def test_a_world_of_one_refuses_pp_as_it_refuses_tp():
    with pytest.raises(ValueError, match=r"^pp=2 does not divide the 1 processes"):
        Phalanx(pp=2)
    with pytest.raises(ValueError, match=r"^tp=2 does not divide the 1 processes"):
        Phalanx(tp=2)


# ---- the watchdog names stages --------------------------------------------------------------------
def test_rank_labels_follow_the_schedules_placement():
    assert schedules.rank_labels(build("ddp", pp=2), "1F1B") == [
        "pipeline stage 0 of 2",
        "pipeline stage 0 of 2",
        "pipeline stage 1 of 2",
        "pipeline stage 1 of 2",
    ]
    assert schedules.rank_labels(build("ddp", world=2, local=2, pp=2), "ZBVZeroBubble") == [
        "pipeline stages 0, 3 of 4",
        "pipeline stages 1, 2 of 4",
    ]


def test_a_stalled_stage_is_named_with_its_rank():
    peers = [PeerView((5, 10, 3, "pipeline"), 100.0, 0.0), PeerView((5, 10, 3, "step"), 100.0, 0.0)]
    verdict = judge(
        peers, now=100.0, timeout=10.0, me=0, labels=schedules.rank_labels(build("ddp", world=2, local=2, pp=2), "1F1B")
    )
    assert verdict.headline.startswith(
        "phalanx watchdog: rank 1 (pipeline stage 1 of 2) stalled at step 3 (phase 'step': in the training script"
    )
    assert verdict.lines == [
        "  rank 0 (pipeline stage 0 of 2): step 3, phase 'pipeline' (waiting)",
        "  rank 1 (pipeline stage 1 of 2): step 3, phase 'step'  <-- stalled",
    ]


# ---- cutting for a plan ------------------------------------------------------------------------
def test_a_meta_models_stage_draws_the_initial_values_of_one_process():
    torch.manual_seed(0)
    whole = TinyLM(4)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyLM(4)
    cut = layout.cut(model, build("ddp", world=2, local=2, pp=2), StrategyOptions(), pp_rank=1)
    meta_init.materialize(model, torch.device("cpu"), order=cut.init_order)
    state = model.state_dict()
    assert set(state) == {k for k in whole.state_dict() if k.startswith(("layers.2.", "layers.3.", "norm.", "head."))}
    for name, value in state.items():
        assert torch.equal(value, whole.state_dict()[name]), name


def test_strategy_auto_sizes_the_largest_pipeline_rank():
    # a block holds 8448 parameters, the embedding and the head 2048 each, the norm 64
    assert layout.largest_rank_units(TinyLM(4), build("ddp", pp=2), StrategyOptions()) == (
        "layers.2",
        "layers.3",
        "norm",
        "head",
    )
    interleaved = layout.largest_rank_units(
        TinyLM(4), build("ddp", pp=2), StrategyOptions(pp_schedule="Interleaved1F1B")
    )
    assert interleaved == ("layers.1", "layers.3", "norm", "head")  # stages 1 and 3: 19008 against 18944


# ---- phalanx plan --pp --------------------------------------------------------------------------
def test_phalanx_plan_gives_each_pipeline_ranks_bytes_and_activations_in_flight(capsys):
    from phalanx import cli

    assert (
        cli.main(["plan", "tests/dist/tp_workloads.py:TinyLM", "--world-size", "4", "--pp", "2", "--input", "8x8"]) == 0
    )
    out = capsys.readouterr().out
    assert (
        "pipeline pp=2, 1F1B, 4 microbatches of each rank's batch, 1 stage(s) per pipeline rank; bubble 20% of a step:"
    ) in out
    rows = re.findall(r"^\s+(\d)  (\d)\s+([\d.]+ KiB)\s+([\d.]+) KiB x\s+(\d+) =\s+([\d.]+) KiB  (.*)$", out, re.M)
    assert [(r[0], r[2], r[4], r[6]) for r in rows] == [
        ("0", "41.0 KiB", "2", "embed, layers.0"),  # 1F1B: pp - r ahead
        ("1", "41.2 KiB", "1", "layers.1, norm, head"),
    ]
    for row in rows:
        assert float(row[5]) == pytest.approx(float(row[3]) * int(row[4]), abs=0.1)
    assert "the strategies below hold pipeline rank 1's stages" in out
    assert re.search(r"^  ddp x pp2 +41\.2 KiB", out, re.M) and re.search(r"^  zero3 x pp2 +20\.6 KiB", out, re.M)
    assert (
        cli.main(
            [
                "plan",
                "tests/dist/tp_workloads.py:TinyLM",
                "--world-size",
                "4",
                "--pp",
                "2",
                "--pp-schedule",
                "gpipe",
                "--pp-microbatches",
                "8",
                "--input",
                "8x8",
            ]
        )
        == 0
    )
    gpipe = capsys.readouterr().out
    assert "GPipe, 8 microbatches" in gpipe and "bubble 11% of a step" in gpipe
    assert [r[4] for r in re.findall(r"^\s+(\d)  (\d)\s+([\d.]+ KiB)\s+([\d.]+) KiB x\s+(\d+) =", gpipe, re.M)] == [
        "8",
        "8",
    ]  # GPipe: every forward before any backward


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp", "3"], "--pp 3 x --tp 1 does not divide --world-size 4. HINT: choose pp among 1, 2, 4"),
        (
            ["--pp", "2", "--pp-schedule", "Interleaved1F1B"],
            "pp=2 with pp_schedule=Interleaved1F1B runs 2 stages per "
            "pipeline rank, 4 in all: pp=4 needs at least 4 blocks",
        ),
        (["--pp", "2", "--pp-microbatches", "1"], "pp_microbatches=1 is smaller than pp=2"),
        (["--pp", "2", "--pp-split", "layers.9"], "pp_split names 'layers.9', which is not a unit"),
    ],
)
def test_phalanx_plan_refuses_pipelines_that_cannot_run(capsys, flags, message):
    from phalanx import cli

    assert cli.main(["plan", "tests/dist/tp_workloads.py:TinyLM", "--world-size", "4", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"phalanx plan: error: {message}")


def test_uneven_inputs_under_pp_agree_step_by_step_and_join_is_refused():
    from torch import nn

    from phalanx.runtime.context import DistContext
    from phalanx.data.uneven import choose_method

    ctx = DistContext(rank=0, world_size=2, dp_size=1)  # pp 2: one replica, its stages read the same data
    ddp_like = [nn.Linear(2, 2)]  # what Join would take under ddp is not what decides under pp
    assert choose_method(ddp_like, ctx, "auto", pipeline=True) == "agree"
    with pytest.raises(ValueError, match=r"^phalanx: torch's Join cannot run pipeline stages \(pp > 1\)"):
        choose_method(ddp_like, ctx, "join", pipeline=True)


def test_uneven_inputs_under_pp_with_data_parallel_replicas_is_refused_at_the_call():
    """pp 2 x ddp 2: the step-level agreement stopped every replica at the shortest one's data, the
    longer ones' extra batches silently untrained (one process trains them all); refused, naming the
    way out, unless `method="agree"` asks for that stop."""
    from torch import nn

    from phalanx.data.uneven import uneven_inputs
    from phalanx.runtime.context import DistContext

    ctx = DistContext(rank=0, world_size=4, dp_size=2)
    with pytest.raises(ValueError) as refused:
        uneven_inputs([nn.Linear(2, 2)], ctx, pipeline=True, layout="ddp: pp 2 x dp 2")
    message = str(refused.value)
    assert message.startswith(
        "phalanx: px.uneven_inputs under pipeline parallel with 2 data-parallel replicas (ddp: pp 2 x dp 2)"
    ), message
    assert "HINT: give every data-parallel rank as many batches" in message and 'method="agree"' in message
    assert uneven_inputs([nn.Linear(2, 2)], ctx, method="agree", pipeline=True).method == "agree"
